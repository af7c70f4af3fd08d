"""Chat prompts for the embedded default model's end-to-end truths, shared by
tests/model/test_default_model.py and scripts/bf16_accuracy.py."""

DEFAULT_MODEL_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain photosynthesis in one sentence.",
    "What is 17 times 3?",
    "Translate 'good morning' into Spanish.",
    "Give me a name for a pet turtle.",
    "Why is the sky blue?",
)
