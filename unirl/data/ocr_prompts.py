"""Training prompts for the OCR (text rendering) task, generated in code: ``unirl://ocr/generated``.

FlowGRPO's OCR training list (``dataset/ocr/train.txt``, about 20k prompts written with a language
model) does not ship with unirl. These prompts follow the form of its test set, which does ship
(``unirl://ocr/test.txt``): one sentence describing a scene in which a surface shows a short text
in double quotes, e.g.

    A close-up photograph of a chalkboard menu propped outside a cafe reading "Quiet Harbor",
    on a cobbled street after the rain, with soft morning light.

The quoted text (what the OCR reward compares with the image; ``unirl/rewards/ocr.py`` reads the text
between the first two double quotes) has 1 to 6 words, mostly 2 to 4 as in the test set. Scenes,
surfaces, settings, details and texts are drawn from the word lists below with a seeded
``random.Random``, so ``generate(n, seed)`` is the same list on every machine; prompts are distinct
and none equals a prompt of the bundled test set. Reproducing FlowGRPO's numbers needs its own list
(``data.train=/path/to/flow_grpo/dataset/ocr/train.txt``).
"""

from __future__ import annotations

import functools
import random

from unirl.data.paths import bundled_path, register_source

#: A surface that carries text, and the words that introduce the text.
SURFACES = [
    ("a hand-painted wooden sign", "reading"), ("a neon sign above a diner door", "glowing with the words"),
    ("a chalkboard menu propped outside a cafe", "reading"), ("a vintage travel poster", "announcing"),
    ("a brass plaque on a stone wall", "engraved with"), ("a birthday cake", "iced with the words"),
    ("a coffee mug", "printed with"), ("a cotton tote bag", "printed with the slogan"),
    ("a street mural", "spelling out"), ("a movie theater marquee", "announcing"),
    ("a handwritten letter", "that begins with"), ("a weathered road sign", "pointing to"),
    ("a bookstore window display", "with a banner reading"), ("a protest placard held high", "demanding"),
    ("a smartphone screen", "showing the notification"), ("a laptop sticker", "that says"),
    ("a hot air balloon", "painted with"), ("a shop awning", "bearing the name"),
    ("a ceramic tile", "glazed with the words"), ("a vintage typewriter page", "typed with"),
    ("a cereal box", "labelled"), ("a wine bottle label", "reading"), ("a baseball cap", "embroidered with"),
    ("a festival wristband", "printed with"), ("a glowing billboard", "advertising"),
    ("a carved pumpkin", "with the words"), ("a sandcastle flag", "that reads"),
    ("a sticky note on a fridge", "saying"), ("a graduation cap", "decorated with"),
    ("a train station departure board", "listing"), ("a bus destination display", "showing"),
    ("a greeting card", "that says"), ("a bakery box", "stamped with"), ("a knitted sweater", "knitted with"),
    ("a skateboard deck", "painted with"), ("a lighthouse door", "carved with"),
    ("a fortune cookie slip", "reading"), ("a museum placard", "titled"), ("a chalk drawing on the pavement", "spelling"),
    ("a vinyl record sleeve", "titled"), ("a book cover", "with the title"), ("a pet's name tag", "engraved with"),
    ("a welcome mat", "woven with"), ("a race finish banner", "reading"), ("a postage stamp", "printed with"),
    ("a robot's chest display", "flashing"), ("a candle jar", "labelled"), ("a classroom whiteboard", "with the words"),
    ("a kite", "painted with"), ("a wooden crate", "stenciled with"), ("a snow globe base", "inscribed with"),
    ("a paper lantern", "brushed with"), ("a digital clock display", "scrolling"), ("a jersey", "printed with"),
    ("a tattoo on a forearm", "spelling out"), ("an old shop window", "painted with the words"),
    ("a parking garage wall", "stenciled with"), ("a spaceship hull", "painted with"),
    ("a handmade quilt", "stitched with"), ("a wedding cake topper", "that reads"),
]

SHOTS = [
    "A close-up photograph of", "A wide shot of", "A detailed illustration of", "A vintage photograph of",
    "A cinematic still of", "A watercolor painting of", "A realistic photo of", "A flat-lay photo of",
    "A high-resolution image of", "A candid snapshot of", "A digital rendering of", "An overhead view of",
]

SETTINGS = [
    "on a cobbled street after the rain", "in a sunlit kitchen", "at the edge of a pine forest",
    "in a busy train station at rush hour", "on a quiet beach at sunset", "in a cluttered artist's studio",
    "on a snowy mountain pass", "in a neon-lit alley at night", "beside a calm lake at dawn",
    "in a crowded night market", "on a wooden desk by a window", "in a cozy library corner",
    "under a starry desert sky", "in a bright school hallway", "at a lively county fair",
    "inside a dusty antique shop", "on a rooftop garden in the city", "in a foggy harbor",
    "beside a country road lined with sunflowers", "in a minimalist white gallery", "at a rainy bus stop",
    "in a greenhouse full of ferns", "on a busy shopping street", "in a quiet hospital corridor",
    "at a campsite under tall trees", "in an underground subway tunnel", "on a frozen pond",
    "in a retro arcade", "at a small-town bakery counter", "on the deck of a sailing boat",
    "in a space station module", "beside a crackling fireplace", "at a sunny farmers market",
    "in an abandoned factory", "on a windswept cliff", "in a children's playroom",
]

DETAILS = [
    "soft morning light", "warm golden-hour tones", "a shallow depth of field", "crisp, clean lettering",
    "moody blue shadows", "vivid saturated colors", "gentle film grain", "dramatic side lighting",
    "a pastel color palette", "reflections on wet pavement", "a playful, cheerful mood",
    "a calm, minimalist composition", "sharp focus on the lettering", "long shadows across the ground",
    "light snow drifting down", "a hazy, dreamlike atmosphere", "bold graphic shapes",
    "steam rising in the cold air", "fairy lights twinkling in the background", "a nostalgic, faded look",
    "bright midday sun", "a deep teal and orange grade", "rain streaking the glass", "scattered autumn leaves",
]

ADJECTIVES = [
    "Quiet", "Golden", "Wild", "Little", "Bright", "Hidden", "Silver", "Lucky", "Brave", "Gentle", "Sunny",
    "Secret", "Ancient", "Electric", "Cozy", "Endless", "Frozen", "Happy", "Lost", "Midnight", "Northern",
    "Open", "Rusty", "Simple", "Velvet", "Wandering", "Young", "Crimson", "Daily", "Fresh", "Humble",
    "Lazy", "Modern", "Noble", "Rapid", "Sweet", "True", "Urban", "Wise", "Cosmic",
]
NOUNS = [
    "Harbor", "Garden", "River", "Lantern", "Market", "Mountain", "Bakery", "Station", "Library", "Orchard",
    "Studio", "Forest", "Meadow", "Planet", "Kitchen", "Workshop", "Island", "Valley", "Bridge", "Canyon",
    "Coffee", "Thunder", "Compass", "Feather", "Journey", "Kingdom", "Lighthouse", "Moon", "Ocean", "Pepper",
    "Rocket", "Signal", "Theater", "Tiger", "Village", "Window", "Cloud", "Falcon", "Maple", "Ember",
    "Harvest", "Horizon", "Summit", "Voyage", "Bicycle", "Dragon", "Melody", "Nest", "Pixel", "Sparrow",
]
VERBS = [
    "Follow", "Find", "Keep", "Save", "Chase", "Build", "Catch", "Light", "Guard", "Plant", "Share", "Trust",
    "Mind", "Hold", "Feed", "Wake", "Paint", "Join", "Cross", "Read",
]
STATES = ["Curious", "Calm", "Kind", "Wild", "Humble", "Hungry", "Bold", "Strong", "Awake", "Golden", "Warm", "Close"]


def _quoted_text(rng: random.Random) -> str:
    """A short title-case text of 1 to 6 words (mostly 2 to 4), with no double quote in it."""
    a, n, n2, v = rng.choice(ADJECTIVES), rng.choice(NOUNS), rng.choice(NOUNS), rng.choice(VERBS)
    patterns = [
        (1, lambda: n), (1, lambda: f"{n}!"),
        (5, lambda: f"{a} {n}"), (4, lambda: f"{n} {n2}"), (3, lambda: f"{v} {rng.choice(STATES)}"),
        (5, lambda: f"{a} {n} {n2}"), (5, lambda: f"{v} the {n}"), (3, lambda: f"{n} of the {n2}"),
        (2, lambda: f"Welcome to the {a} {n}"), (2, lambda: f"{n} Since {rng.randint(1890, 2024)}"),
        (2, lambda: f"Gate {rng.randint(1, 99)} {n}"), (3, lambda: f"{v} the {a} {n}"),
        (2, lambda: f"The {a} {n} Club"), (1, lambda: f"{v} the {n}, {rng.choice(VERBS)} the {n2}"),
    ]
    weights = [w for w, _ in patterns]
    return rng.choices(patterns, weights=weights)[0][1]()


def _prompt(rng: random.Random) -> str:
    surface, verb = rng.choice(SURFACES)
    shot, setting, detail = rng.choice(SHOTS), rng.choice(SETTINGS), rng.choice(DETAILS)
    text = _quoted_text(rng)
    form = rng.randrange(4)
    if form == 0:
        return f'{shot} {surface} {verb} "{text}", {setting}, with {detail}.'
    if form == 1:
        return f'{surface[0].upper()}{surface[1:]} {verb} "{text}" {setting}, captured with {detail}.'
    if form == 2:
        return f'{setting[0].upper()}{setting[1:]}, {surface} {verb} "{text}" catches the eye, {detail} all around.'
    return f'{shot} {surface} {verb} "{text}" {setting}. The scene has {detail} and {rng.choice(DETAILS)}.'


def generate(n: int, seed: int = 0, *, exclude: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """``n`` distinct OCR training prompts from ``seed``; none is in ``exclude`` (the test prompts).

    >>> a = generate(3, seed=1)
    >>> a == generate(3, seed=1), len(set(a)), all(p.count('"') == 2 for p in a)
    (True, 3, True)
    """
    if n < 1:
        raise ValueError(f"the number of generated OCR prompts must be >= 1, got {n}")
    rng = random.Random(seed)
    out: list[str] = []
    seen = set(exclude)
    # Far more combinations exist than anyone asks for; the bound only stops a pathological n.
    for _ in range(50 * n + 1000):
        prompt = _prompt(rng)
        if prompt not in seen:
            seen.add(prompt)
            out.append(prompt)
            if len(out) == n:
                return out
    raise ValueError(f"could not generate {n} distinct OCR prompts (got {len(out)}); ask for fewer")


@register_source("ocr/generated", defaults={"n": 20000, "seed": 0}, rows=False,
                 about="OCR training prompts of the test set's form, made in code (unirl/data/ocr_prompts.py)")
@functools.lru_cache(maxsize=4)
def generated(n: int, seed: int) -> tuple[str, ...]:
    """``unirl://ocr/generated?n=N&seed=S``: ``generate`` with the bundled test prompts excluded."""
    test = bundled_path("ocr/test.txt").read_text(encoding="utf-8").splitlines()
    return tuple(generate(n, seed, exclude={line.strip() for line in test}))
