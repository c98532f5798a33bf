"""What the hardware is: catalog.py (published devices, links and nodes; no torch), curves.py
(measured rates as the planner reads them; no torch) and probe.py (this machine, measured once
and cached). Imports config and launch."""
