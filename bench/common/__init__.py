"""What every benchmark tool shares: the machine and its readings, system names and worker
processes (systems.py), goals, the JSON file and HTML pieces (report.py)."""
