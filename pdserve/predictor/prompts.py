"""Prompts for training the length predictor, made from templates and word lists.

TetriInfer trains on ShareGPT prompts; this machine reaches no dataset hub, so the set is
generated: tasks whose natural answers run from one word to a long story, so that the
served model's output lengths spread over its whole range. Each `TaskKind` is a family of
templates with slots filled from the word lists below; `make_prompts(n, seed)` draws n
distinct prompts, the kinds in turn, so every kind is represented whatever n is. The same
(n, seed) always gives the same prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

COUNTRIES = (
    "France", "Japan", "Brazil", "Kenya", "Canada", "India", "Egypt", "Norway", "Mexico",
    "Australia", "Italy", "Peru", "Vietnam", "Germany", "Spain", "Chile", "Ghana", "Poland",
    "Turkey", "Thailand", "Argentina", "Sweden", "Morocco", "Greece", "Ireland", "Nepal",
)  # fmt: skip
ANIMALS = (
    "cat", "dog", "owl", "dolphin", "elephant", "fox", "penguin", "turtle", "rabbit", "wolf",
    "octopus", "horse", "bee", "lion", "parrot", "frog", "whale", "squirrel", "bat", "crow",
    "koala", "shark", "giraffe", "hedgehog", "mouse", "camel",
)  # fmt: skip
OBJECTS = (
    "a bicycle", "the moon", "a lighthouse", "an old clock", "a library", "a volcano",
    "a river", "a train station", "a piano", "a garden", "a bridge", "a castle", "the ocean",
    "a market", "a mountain", "a kitchen", "a telescope", "a forest", "a snowstorm",
    "a city at night", "an island", "a desert", "a museum", "a school", "a rainy day",
)  # fmt: skip
CONCEPTS = (
    "photosynthesis", "gravity", "inflation", "democracy", "the water cycle", "evolution",
    "electricity", "machine learning", "the immune system", "climate change", "supply and "
    "demand", "plate tectonics", "the internet", "vaccines", "black holes", "recycling",
    "compound interest", "the stock market", "renewable energy", "DNA", "the French "
    "Revolution", "sleep", "friendship", "memory", "volcanoes", "magnetism", "rainbows",
    "tides", "the seasons", "encryption", "a healthy diet", "exercise", "meditation",
)  # fmt: skip
PROFESSIONS = (
    "teacher", "doctor", "farmer", "pilot", "chef", "engineer", "nurse", "painter",
    "firefighter", "librarian", "scientist", "musician", "carpenter", "lawyer", "gardener",
)  # fmt: skip
ADJECTIVES = (
    "happy", "big", "fast", "cold", "bright", "quiet", "strong", "old", "brave", "kind",
    "small", "angry", "smart", "rich", "soft", "dark", "funny", "calm", "strange", "clean",
)  # fmt: skip
LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese")
CATEGORIES = (
    "fruits", "vegetables", "colors", "countries in Europe", "musical instruments",
    "sports", "planets", "programming languages", "animals that live in the sea",
    "kitchen tools", "flowers", "famous scientists", "board games", "types of weather",
    "jobs", "things to do on a weekend", "healthy snacks", "tips for studying",
    "ways to save money", "reasons to learn a language", "hobbies", "breakfast foods",
)  # fmt: skip
CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "sorts a list of numbers", "counts the vowels in a string", "finds the largest number "
    "in a list", "returns the Fibonacci sequence up to n", "checks whether a word is a "
    "palindrome", "merges two sorted lists", "removes duplicates from a list", "converts "
    "Celsius to Fahrenheit", "computes the average of a list", "reads a file and counts its "
    "lines", "implements binary search", "validates an email address", "implements a stack "
    "class", "parses a CSV line", "computes the greatest common divisor of two numbers",
)  # fmt: skip
SENTENCES = (
    "The weather is nice today.", "I would like a cup of coffee.", "Where is the train "
    "station?", "My brother plays the guitar.", "We are going to the beach tomorrow.",
    "This book is very interesting.", "Can you help me, please?", "The cat is sleeping on "
    "the sofa.", "I have two sisters and one brother.", "The store opens at nine o'clock.",
)  # fmt: skip
NAMES = ("Anna", "Ben", "Carla", "David", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jonas")
PASSAGES = (
    "The town council met on Tuesday to discuss the new park. Residents asked for more "
    "trees, a playground and benches. The council agreed to spend part of the budget on "
    "the project, and work will begin in the spring.",
    "Honey bees live in colonies with a single queen, thousands of workers and a few "
    "drones. Workers collect nectar and pollen, build the comb and care for the young. "
    "The queen lays up to two thousand eggs a day in summer.",
    "The first bicycles had no pedals: riders pushed along the ground with their feet. "
    "Pedals were added to the front wheel in the 1860s, and the chain-driven safety "
    "bicycle with two wheels of equal size appeared in the 1880s.",
    "A good night's sleep helps the brain store memories and the body repair itself. "
    "Adults need seven to nine hours. Screens before bed, caffeine and irregular hours "
    "make it harder to fall asleep.",
    "The company reported higher sales this quarter, mostly from its new phone. Costs also "
    "rose because of shipping delays. The chief executive said she expects a strong "
    "holiday season.",
)  # fmt: skip


OPENERS = ("", "", "Please: ", "Hi! ", "Quick question. ", "Could you help me? ", "Task: ")
CLOSERS = ("", "", " Thank you.", " Keep it short.", " Be detailed.", " Use simple words.")
CODE_LANGUAGES = ("Python", "JavaScript", "Go", "Rust", "Java", "C")


@dataclass(frozen=True)
class TaskKind:
    name: str
    templates: tuple[str, ...]


KINDS = (
    TaskKind(
        "one-word",
        (
            "What is the capital of {country}? Answer with one word.",
            "Is a {animal} a mammal? Answer yes or no.",
            "What is the opposite of {adjective}? Reply with a single word.",
            "What is {a} plus {b}? Give only the number.",
            "Which continent is {country} in? One word only.",
            "Give one synonym for {adjective}.",
        ),
    ),
    TaskKind(
        "short",
        (
            "In one sentence, what is {concept}?",
            "Translate into {language}: {sentence}",
            "What does a {profession} do? Answer briefly.",
            "Describe a {animal} in one sentence.",
            "Write a haiku about {object}.",
            "What is {a} times {b}?",
            "Give me a short title for a story about a {adjective} {animal}.",
        ),
    ),
    TaskKind(
        "list",
        (
            "List {n} {category}.",
            "Name {n} {category}, one per line.",
            "Give me a numbered list of {n} {category}.",
            "What are {n} facts about {country}?",
            "List {n} things a {profession} needs at work.",
        ),
    ),
    TaskKind(
        "explain",
        (
            "Explain {concept} to a ten-year-old.",
            "Explain {concept} in detail.",
            "Why is {concept} important?",
            "What are the advantages and disadvantages of {concept}?",
            "How does {concept} work? Explain step by step.",
            "Describe the culture and food of {country}.",
            "Summarize this text: {passage}",
            "What is the main idea of the following paragraph? {passage}",
        ),
    ),
    TaskKind(
        "story",
        (
            "Write a short story about a {adjective} {animal}.",
            "Write a story about {name}, a {profession} who finds {object}.",
            "Write a long story about a trip to {country}.",
            "Write a poem about {object}.",
            "Write a fairy tale about a {animal} and a {animal2}.",
            "Write an email to {name} inviting them to visit {object}.",
            "Write a letter to a friend about your new job as a {profession}.",
            "Write an essay about {concept}.",
        ),
    ),
    TaskKind(
        "code",
        (
            "Write a {code_language} function that {code_task}.",
            "Write a {code_language} function that {code_task}, with comments and an example.",
            "Show me how to write a {code_language} program that {code_task}.",
            "Write only the code of a {code_language} function that {code_task}.",
        ),
    ),
)


def _fill(template: str, rng: random.Random) -> str:
    animal, animal2 = rng.sample(ANIMALS, 2)
    task = template.format(
        country=rng.choice(COUNTRIES),
        animal=animal,
        animal2=animal2,
        adjective=rng.choice(ADJECTIVES),
        a=rng.randint(2, 99),
        b=rng.randint(2, 99),
        concept=rng.choice(CONCEPTS),
        language=rng.choice(LANGUAGES),
        sentence=rng.choice(SENTENCES),
        profession=rng.choice(PROFESSIONS),
        object=rng.choice(OBJECTS),
        n=rng.randint(3, 15),
        category=rng.choice(CATEGORIES),
        code_task=rng.choice(CODE_TASKS),
        name=rng.choice(NAMES),
        passage=rng.choice(PASSAGES),
        code_language=rng.choice(CODE_LANGUAGES),
    )
    return rng.choice(OPENERS) + task + rng.choice(CLOSERS)


def make_prompts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """`n` distinct (kind name, prompt) pairs, the kinds in turn (module docstring)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    attempts = 0
    while len(out) < n:
        kind = KINDS[len(out) % len(KINDS)]
        text = _fill(rng.choice(kind.templates), rng)
        attempts += 1
        if text in seen:
            if attempts > 50 * n:
                raise ValueError(f"the templates give fewer than {n} distinct prompts")
            continue
        seen.add(text)
        out.append((kind.name, text))
    return out
