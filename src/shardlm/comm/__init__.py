"""Communication below every strategy: collectives.py (each call counted in a byte ledger by
operation and group) and watchdog.py (a collective that outlives its timeout is reported)."""
