"""``higgs-pack serve`` measured from outside: the load test (load.py, ``nox -s serve-bench``: its
requests and judge in checks.py, live sessions in live.py, the event-loop stall in stall.py, the
server and engine processes in workers.py, goals and pages in report.py), the agent benchmark
(agent.py, ``nox -s agent-bench``) and the response formats' and speeds' cost (formats.py)."""
