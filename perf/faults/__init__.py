"""The fault suite, one module per scenario; `python -m perf.faults` runs it (see __main__)."""
