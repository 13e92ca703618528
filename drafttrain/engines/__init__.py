"""Serving engines run for real against drafttrain's exports (the engine test tier, scripts/check_engine.py).

``vllm_driver.py`` runs inside the engine venv (scripts/make_engine_venv.sh) as a plain script; ``vllm_check.py`` is
the main environment's side: the venv's location, the driver call, drafttrain's own decode of the same prompts
and the per-prompt comparison. ``vllm_capture_driver.py`` (with ``vllm_hs_connector.py``, which vLLM loads by module
path) is the engine side of ``capture.backend=vllm`` (drafttrain/capture/vllm.py): vLLM's ``extract_hidden_states``
over the rows to capture.
"""
