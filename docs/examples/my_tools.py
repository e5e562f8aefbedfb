"""A user's own tools, as docs/tools.md writes them: plain functions taking a call's arguments by name and
returning the text the model is shown. ``search`` is a search of one's own over a JSONL corpus of
``{id, contents}`` rows (title line, then text): an exact lookup of the title, not BM25. Named ``search``,
Search-R1's tags call it (``rollout.call_format=search_r1`` calls only a tool of that name). Its text keeps to
characters the tiny model's tokenizer has (letters, digits, ``:.,``; no ``_`` or quotes), which drops others."""

import json

DEFINITIONS = {"gradient": "the direction of steepest ascent", "epoch": "one pass over the data"}


def define(word: str, default: str = "unknown word") -> str:
    """The definition of a word from a small glossary."""
    return DEFINITIONS.get(word.strip().lower(), default)


def search(query: str, corpus: str = "corpus.jsonl") -> str:
    """The passage whose title is the query's first word ("Bako. What is its code?" looks up "Bako")."""
    words = query.replace(".", " ").split()
    wanted = words[0].lower() if words else ""
    with open(corpus) as f:
        for line in f:
            title, _, text = json.loads(line)["contents"].partition("\n")
            if title.lower() == wanted:
                return f"mytools found {title}: {text}"
    return f"mytools found nothing for {query.strip()}"
