"""Deployment: run the project's model repository on the tritonserver of the nvidia-pytriton wheel.

``deploy.triton`` finds the server and lays out its backend directory; ``deploy.triton_adapter`` holds
the Triton-independent logic of ``model_repository/hybrid_llm/1/model.py`` (parameter and request parsing,
response building) and ``deploy.inflight`` its threads (response sending, cancellation polling);
``deploy.triton_metrics`` mirrors the runtime's metrics into Triton's metrics endpoint.
``python -m deploy serve`` is what ``make serve`` runs.
"""
