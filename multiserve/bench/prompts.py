"""The benchmark's fixed prompt list: 72 user messages of deliberately varied length.

Owns only data. Invariants: the list never changes between runs (so numbers taken on
different days compare), every prompt is distinct (so a prefix cache only shares the
chat template's system preamble, never a whole prompt), and lengths span 35 to 529
tokens once chat-templated with SmolLM2's template (64 prompts: 10352 tokens in all):
24 short, 24 medium, 24 long (the long ones are the medium requests followed by a fixed
background passage, one to three times, and a task, so the text stays in this file).
"""

from __future__ import annotations

_SHORT: tuple[str, ...] = (
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 17 multiplied by 23?",
    "Give me a synonym for 'happy'.",
    "Why is the sky blue?",
    "Who wrote the play Romeo and Juliet?",
    "What does a thermometer measure?",
    "Suggest a name for a pet goldfish.",
    "What is the boiling point of water at sea level in Celsius?",
    "List four planets of the solar system.",
    "What is the opposite of 'ancient'?",
    "How do bees make honey?",
    "Write a haiku about autumn leaves.",
    "What is photosynthesis, in one sentence?",
    "Which ocean is the largest?",
    "Explain what a prime number is.",
    "Give one tip for sleeping better.",
    "What language is spoken in Brazil?",
    "Tell me a short joke about computers.",
    "How many minutes are there in a day?",
    "What is the chemical symbol for gold?",
    "Describe the taste of a lemon.",
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

_LONG_CONTEXT = (
    "Background notes from the person asking, which may or may not be relevant: they "
    "live in a small apartment with a balcony, work shifts that change every week, share "
    "a car with a sibling, prefer written instructions over videos, and have a budget "
    "that is tight at the end of each month. They have tried several apps for planning "
    "and reminders but stopped using each of them after a few weeks because entering "
    "everything took too long. They enjoy cooking on days off, read mostly on their "
    "phone, and would like advice that still works during busy weeks. They mentioned "
    "that they learn best when a plan has small, concrete steps with a clear reason for "
    "each step, and that they dislike advice that assumes a lot of free time. "
)


def _long_prompts() -> tuple[str, ...]:
    out = []
    for i, body in enumerate(_MEDIUM):
        task = _LONG_TASKS[i % len(_LONG_TASKS)]
        repeat = 1 + (i % 3)  # three long sizes
        # The request comes first, so long prompts share no prefix with each other.
        out.append(f"Request: {body}\n\n{_LONG_CONTEXT * repeat}\n{task}")
    return tuple(out)


BENCH_PROMPTS: tuple[str, ...] = _SHORT + _MEDIUM + _long_prompts()


def bench_prompts(n: int) -> list[str]:
    """The first n prompts of the interleaved list (short, medium, long, short, ...),
    cycling when n exceeds the list (repeats then hit the prefix cache), so any n gets a
    mix of lengths."""
    assert n >= 1
    groups = (_SHORT, _MEDIUM, _long_prompts())
    mixed = [g[i] for i in range(len(_SHORT)) for g in groups]
    return [mixed[i % len(mixed)] for i in range(n)]
