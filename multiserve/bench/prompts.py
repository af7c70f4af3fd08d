"""The benchmark's fixed prompt list: 72 user messages of deliberately varied length.

Owns only data. Invariants: the list never changes between runs (so numbers taken on
different days compare), every prompt is distinct (so a prefix cache only shares the
chat template's system preamble, never a whole prompt), and every prompt has 8 to 120
words (the issue-11 prompt set: 64 prompts of 8-120 words x 128 greedy tokens), which is
40 to 173 tokens once chat-templated with SmolLM2's template (64 prompts: 5743 tokens in
all): 24 short (8-14 words), 24 medium (22-46), 24 long (101-120: a medium request, then
background sentences added while the prompt stays within 120 words, then a task).
"""

from __future__ import annotations

_SHORT: tuple[str, ...] = (
    "What is the capital of France, and what river runs through it?",
    "Name the three primary colors used when mixing paint.",
    "How many legs does a spider have, and how many does an ant have?",
    "Translate the greeting 'good morning' into Spanish and into French.",
    "What is 17 multiplied by 23? Show the working briefly.",
    "Give me two synonyms for the word 'happy', please.",
    "Why is the sky blue on a clear day?",
    "Who wrote the play Romeo and Juliet, and roughly when?",
    "What does a thermometer measure, and in which units?",
    "Suggest a funny name for my new pet goldfish.",
    "What is the boiling point of water at sea level in Celsius?",
    "List four planets of the solar system in order from the sun.",
    "What is the opposite of the word 'ancient' in English?",
    "How do honey bees turn flower nectar into honey?",
    "Write a short haiku about falling autumn leaves.",
    "What is photosynthesis? Explain it in one simple sentence.",
    "Which ocean is the largest on Earth, and how deep is it?",
    "Explain what a prime number is, with two examples.",
    "Give me one practical tip for sleeping better at night.",
    "What language do most people speak in Brazil, and why?",
    "Tell me a short, friendly joke about computers and programmers.",
    "How many minutes are there in a day? Explain the calculation.",
    "What is the chemical symbol for gold, and where does it come from?",
    "Describe the taste of a fresh lemon to someone who never had one.",
)

_MEDIUM: tuple[str, ...] = (
    "I am planning a three-day trip to a mountain town in early spring. The weather can "
    "change quickly, with sunny mornings and snowy afternoons. What should I pack, and "
    "how should I plan each day so that I can still enjoy myself if a storm arrives?",
    "My tomato plants have yellow leaves near the bottom, and some of the leaves have "
    "small brown spots. I water them every evening and they get about six hours of sun. "
    "What could be causing this, and what simple steps can I take to fix it?",
    "Explain to a ten-year-old how a refrigerator keeps food cold. Use a simple "
    "comparison with something they already know, and avoid technical words unless you "
    "explain them right away.",
    "I have to give a five-minute talk at work about why our team should write more "
    "automated tests. Most of my colleagues think tests slow them down. Outline the talk "
    "with an opening, three main points, and a short closing.",
    "A small bakery sells bread, cakes and cookies. Bread sells steadily every day, cakes "
    "sell mostly on weekends, and cookies sell best when school ends. Suggest a weekly "
    "baking schedule that keeps waste low and shelves full.",
    "Write a short, friendly email to a neighbour asking if they could water my plants "
    "while I am away for a week. Offer to return the favour and mention where the "
    "watering can is kept.",
    "Compare trains and airplanes for a journey of about five hundred kilometres. "
    "Consider total travel time including getting to the station or airport, cost, "
    "comfort, and the effect on the environment.",
    "I started learning the guitar two months ago. I can play a few chords, but switching "
    "between them is still slow and my fingertips hurt. How should I practise over the "
    "next month to improve steadily without getting discouraged?",
    "Describe the water cycle in four or five clear steps. For each step, give one "
    "everyday example that a person might notice without any special equipment.",
    "Our book club wants to read something that will start a good discussion but is not "
    "too long. Members like history, mysteries and stories about families. Suggest what "
    "kind of book to pick and three questions we could discuss.",
    "Explain the difference between weather and climate. Then give an example of a "
    "statement about weather and a statement about climate, and say why each one belongs "
    "in its category.",
    "I want to start running but I have never exercised regularly. I can walk for an hour "
    "without trouble. Design a gentle eight-week plan that ends with running for thirty "
    "minutes without stopping.",
    "A friend says that reading on a screen is just as good as reading on paper. Give "
    "balanced arguments for both sides and end with a short conclusion about when each "
    "format works better.",
    "Write a product description for a reusable water bottle that keeps drinks cold for "
    "twenty-four hours. It is made of steel, weighs three hundred grams, and comes in "
    "four colours. Keep it under one hundred words.",
    "Explain what compound interest is and why starting to save early matters. Use a "
    "simple example with round numbers over ten years to show the effect.",
    "My cat suddenly started scratching the sofa even though she has a scratching post. "
    "Nothing else in the house has changed. What might be going on, and how can I "
    "gently redirect her behaviour?",
    "Summarise the main causes of the fall of the Western Roman Empire in a way that a "
    "high-school student could remember for an exam, using a short list.",
    "I need to organise a birthday party for twelve children aged six to eight in a small "
    "garden. Suggest a two-hour programme with games, food and a calm activity at the end.",
    "What are the advantages and disadvantages of working from home? Consider "
    "productivity, communication with colleagues, work-life balance and costs for both "
    "the employee and the company.",
    "Explain how a bill becomes a law in a typical parliamentary democracy. Keep it "
    "general, name the main stages, and point out where most proposals fail.",
    "Write a short story opening, no more than six sentences, about a lighthouse keeper "
    "who finds a message in a bottle that seems to be addressed to her.",
    "I keep forgetting to drink enough water during the day. Give me practical, specific "
    "habits I can try at home and at the office, and explain why each one works.",
    "Explain how vaccines help the immune system recognise a disease. Mention memory "
    "cells and why some vaccines need more than one dose.",
    "Plan a simple vegetarian dinner for four people that can be cooked in under an hour "
    "with common ingredients. Give the menu and the order in which to prepare things.",
)

_LONG_TASKS: tuple[str, ...] = (
    "Rewrite the request above as a numbered checklist, then answer it in detail.",
    "Read the request above carefully. First list any assumptions you would make, then "
    "give a thorough answer, and finish with a one-sentence summary.",
    "Answer the request above twice: once for a complete beginner and once for an "
    "expert. Label the two answers clearly.",
)

_LONG_CONTEXT: tuple[str, ...] = (  # background sentences, added while the prompt fits
    "Background: I live in a small apartment with a balcony and work shifts that change "
    "every week.",
    "I share a car with my sister, prefer written instructions over videos, and my budget "
    "is tight at the end of each month.",
    "I tried several planning apps but stopped using each one after a few weeks because "
    "entering everything took too long.",
    "I enjoy cooking on days off, read mostly on my phone, and want advice that still works "
    "during busy weeks.",
    "I learn best from small, concrete steps with a clear reason for each, and I dislike "
    "advice that assumes a lot of free time.",
)

MAX_WORDS = 120  # the prompt set: 8 to 120 words per prompt


def _long_prompts() -> tuple[str, ...]:
    out = []
    for i, body in enumerate(_MEDIUM):
        task = _LONG_TASKS[i % len(_LONG_TASKS)]
        # The request comes first, so long prompts share no prefix with each other.
        text = f"Request: {body}\n\n{task}"
        context: list[str] = []
        for k in range(len(_LONG_CONTEXT)):
            sentence = _LONG_CONTEXT[(i + k) % len(_LONG_CONTEXT)]
            longer = f"Request: {body}\n\n{' '.join([*context, sentence])}\n{task}"
            if len(longer.split()) > MAX_WORDS:
                break
            context.append(sentence)
            text = longer
        out.append(text)
    return tuple(out)


BENCH_PROMPTS: tuple[str, ...] = _SHORT + _MEDIUM + _long_prompts()


def bench_prompts(n: int) -> list[str]:
    """The first n prompts of the interleaved list (short, medium, long, short, ...),
    cycling when n exceeds the list (repeats then hit the prefix cache), so any n gets a
    mix of lengths."""
    assert n >= 1
    groups = (_SHORT, _MEDIUM, _long_prompts())
    mixed = [g[i] for i in range(len(_SHORT)) for g in groups]
    assert len(mixed) == NUM_BENCH_PROMPTS
    return [mixed[i % len(mixed)] for i in range(n)]


NUM_BENCH_PROMPTS = 3 * len(_SHORT)  # the list's length: 24 short, 24 medium, 24 long
