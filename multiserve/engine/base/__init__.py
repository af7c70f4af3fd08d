"""The engine's leaf utilities, with no jax: every room of the engine may import them, and
they import nothing of the engine (tests/test_import_layers.py). The compute dtype's choice
(`dtype_choice`), frozen values built fast (`frozen_build`), the KV pool's size rule
(`kv_sizing`), the LoRA adapters' checks and slots (`lora_adapters`), the pause reasons
(`pause_state`), routing replay's expert table (`routed_experts`) and the stop strings'
decision (`stop_strings`)."""
