"""An OpenAI-compatible HTTP API in front of tritonserver: ``python -m frontend``.

Its own process (FastAPI + uvicorn), stateless, talking to Triton through tritonclient's asyncio gRPC
client, so several can run in front of one server. ``frontend.app`` holds the routes, ``frontend.triton``
the Triton side, ``frontend.protocol`` request parsing, ``frontend.responses`` the response objects,
``frontend.chat`` chat templates and ``frontend.errors`` the OpenAI error objects;
``frontend.process.FrontendProcess`` starts one as a child process (``make serve``, the tests).
"""
