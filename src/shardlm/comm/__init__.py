"""Communication below every strategy: collectives.py (each call counted in a byte ledger by
operation and group), watchdog.py (a collective that outlives its timeout is reported) and
mesh.py (the rank grid as named process groups). Imports config, launch and hardware."""
