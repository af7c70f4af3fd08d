"""The speculation benchmark's grounded prompts: tasks whose answer copies, rewrites or
extracts from a passage given in the prompt, or edits a code snippet given in it (the
workloads where prompt-lookup drafts pay: summarisation, context QA, code edits, agent
tool results). Owns only data; the list never changes between runs."""

from __future__ import annotations

_PASSAGES: tuple[str, ...] = (
    "The lighthouse stood on a narrow spit of rock at the mouth of the harbour. Every "
    "night for sixty years its keeper climbed the one hundred and twelve steps, trimmed "
    "the wick, wound the clockwork that turned the great lens, and wrote the weather in "
    "a leather logbook. Ships from the north used its beam to find the deep channel "
    "between the sandbanks, and fishermen said that on clear nights the light could be "
    "seen from the cliffs of the next county.",
    "To reset the router, first unplug the power cable and wait thirty seconds. Then "
    "hold down the small reset button on the back with a paper clip while you plug the "
    "cable back in. Keep holding the button until the front light blinks orange three "
    "times. Release the button and wait two minutes for the router to restart. The "
    "default network name and password are printed on the label under the router.",
    "Photosynthesis takes place in the chloroplasts of plant cells. Light energy is "
    "absorbed by chlorophyll and used to split water molecules, releasing oxygen. The "
    "energy is stored in two carrier molecules, which then power the Calvin cycle. In "
    "the Calvin cycle, carbon dioxide from the air is fixed into sugars that the plant "
    "uses for growth and for energy at night.",
    "Minutes of the garden committee, March meeting. Present: Alice, Bob, Carol and "
    "David. Alice reported that the new compost bins have arrived and will be installed "
    "on Saturday. Bob proposed planting tomatoes along the south fence; the proposal was "
    "accepted. Carol will order seeds before the end of the month. David raised the "
    "problem of the broken gate, and Bob agreed to repair it. Next meeting: April 12.",
)

_CODE: tuple[str, ...] = (
    "def total_price(items):\n"
    "    total = 0\n"
    "    for item in items:\n"
    "        total = total + item['price'] * item['quantity']\n"
    "    return total\n",
    "def find_user(users, name):\n"
    "    for user in users:\n"
    "        if user['name'] == name:\n"
    "            return user\n"
    "    return None\n",
)

_PASSAGE_TASKS: tuple[str, ...] = (
    "Copy the following passage exactly, word for word:\n\n{p}",
    "Repeat this text back to me without changing anything:\n\n{p}",
    "Here is a passage:\n\n{p}\n\nRewrite the passage in the past tense where needed, "
    "keeping every sentence.",
    "Read the passage and quote the sentences that contain a number:\n\n{p}",
)

_CODE_TASKS: tuple[str, ...] = (
    "Here is a Python function:\n\n{p}\nRename the function to compute_total and return "
    "the whole edited function.",
    "Add a docstring to this Python function and return the whole function:\n\n{p}",
)


def grounded_prompts(n: int) -> list[str]:
    """n grounded prompts, cycling through passage and code tasks (repeats when n is
    larger than the list: they then share a prefix with an earlier prompt)."""
    assert n >= 1
    prompts = [t.format(p=p) for p in _PASSAGES for t in _PASSAGE_TASKS]
    prompts += [t.format(p=p) for p in _CODE for t in _CODE_TASKS]
    order = [prompts[(i * 7) % len(prompts)] for i in range(len(prompts))]
    return [order[i % len(order)] for i in range(n)]
