"""The prompts of `tandem bench engine --spec-*`: chat requests whose answers repeat spans of
the prompt (quote, summarise with quotes, edit a text or code and return it), where prompt-lookup
drafts can be accepted, and free chat, where the answer is new text and drafts rarely are.
Written as plain tasks a user would send, not tuned to any figure."""

from __future__ import annotations

from tandem.tokens.tokenizer import ModelTokenizer

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"

_NOTICE = (
    "The committee met on Tuesday to review the annual budget. After a long discussion, the "
    "members agreed to increase funding for public libraries by ten percent, to repair the "
    "bridge on Main Street before winter, and to hire two new teachers for the primary school. "
    "The mayor thanked everyone for their work and closed the meeting at nine o'clock."
)

_RECIPE = (
    "To make the bread, mix five hundred grams of flour with one teaspoon of salt and seven "
    "grams of dry yeast. Add three hundred and fifty millilitres of warm water and knead the "
    "dough for ten minutes until it is smooth. Leave it in a warm place for one hour, shape it "
    "into a loaf, and bake it at two hundred degrees for thirty five minutes."
)

_CODE = """def average(values):
    total = 0
    n = 0
    for v in values:
        total = total + v
        n = n + 1
    if n == 0:
        return 0
    return total / n


def report(values):
    print("count:", len(values))
    print("average:", average(values))
"""

_TYPOS = (
    "Our team will be travelling to the conferance next week. Please send me your presentaton "
    "slides by Friday so that I can check them before we leave. The hotel is close to the "
    "venue, and brekfast is included every morning."
)

QUOTE_TASKS = (
    f"Repeat the following text exactly, word for word:\n\n{_NOTICE}",
    f"Here is a recipe:\n\n{_RECIPE}\n\nCopy the recipe above, then add one sentence of advice.",
    "Rename the function `average` to `mean` everywhere in this code and return the whole "
    f"file:\n\n```python\n{_CODE}```",
    f"Fix the spelling mistakes in this email and return the corrected email in full:\n\n{_TYPOS}",
)

CHAT_TASKS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good habits for staying healthy? Explain each one.",
    "Explain how rainbows form, in simple words.",
    "Describe a perfect weekend in the mountains.",
)

WORKLOADS = {"quote": QUOTE_TASKS, "chat": CHAT_TASKS}


def chat_prompts(tokenizer: ModelTokenizer, tasks: tuple[str, ...]) -> list[list[int]]:
    """Token ids of each task as one user turn of SmolLM2's chat template."""
    return [tokenizer.encode(CHAT.format(t), add_special_tokens=False) for t in tasks]
