"""The people, things and containers the built-in word problems (rlhf.tasks.word_problems)
and their long contexts (rlhf.tasks.long_context) speak of."""

NAMES = (
    "Maya", "Liam", "Ava", "Noah", "Emma", "Omar", "Sofia", "Lucas", "Mia", "Ethan", "Zara", "Leo", "Nina",
    "Ravi", "Chloe", "Mateo", "Grace", "Hugo", "Aisha", "Ben", "Lena", "Kai", "Iris", "Tom",
)  # fmt: skip
# (plural noun, container) pairs: "boxes of pencils".
THINGS = (
    ("stickers", "pack"), ("marbles", "bag"), ("pencils", "box"), ("apples", "basket"), ("cookies", "tray"),
    ("cards", "deck"), ("stamps", "album"), ("books", "shelf"), ("beads", "jar"), ("eggs", "carton"),
    ("shells", "bucket"), ("crayons", "box"), ("buttons", "tin"), ("candies", "bag"), ("flowers", "vase"),
)  # fmt: skip
# Things bought at a price, for the held-out family.
GOODS = ("notebooks", "pens", "mugs", "toy cars", "plants", "candles", "hats", "scarves", "puzzles", "lamps")
CONTAINERS = {"box": "boxes", "shelf": "shelves", "bucket": "buckets", "bag": "bags", "pack": "packs",
              "basket": "baskets", "tray": "trays", "deck": "decks", "album": "albums", "jar": "jars",
              "carton": "cartons", "tin": "tins", "vase": "vases"}  # fmt: skip
