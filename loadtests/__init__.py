"""Load, soak and fault tests against a running ``hybrid_llm`` Triton server.

* ``locustfile.py`` — the locust users (gRPC streaming, HTTP ``generate_stream``, faults); run it through
  ``python -m loadtests.soak`` (``make soak``), or by hand: ``locust -f loadtests/locustfile.py --host
  http://127.0.0.1:8000`` against ``make serve``.
* ``soak.py`` — the soak runner: starts the server (or uses ``URL``), warms up, runs locust headless,
  watches readiness, then checks drain, memory and shared memory and prints a verdict (exit code).
* ``bench_serve.py`` — ``make bench-serve``: genai-perf at concurrency 1, 4 and 16.
"""
