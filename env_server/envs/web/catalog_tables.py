"""The product types the default catalog is generated from: WebShop's five categories, written here.

Each :class:`ProductType` names what a shopper asks for (``query``: the search that would find
it, as WebShop's scraped products each came from a query), the category path its products sit
under, the nouns of its name (what WebShop's type reward compares, see :mod:`.reward`), the
attributes its products may have, the options a buyer picks (size, colour, flavour, ...) and a
price range in dollars. 40 types x :data:`.catalog.PRODUCTS_PER_TYPE` products make the catalog.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProductType:
    query: str
    category: str  # WebShop's top-level category: beauty, grocery, fashion, furniture, electronics
    path: tuple[str, ...]  # the product category path, top first
    nouns: tuple[str, ...]  # the nouns of the type's name, lower case
    attributes: tuple[str, ...]
    options: dict[str, tuple[str, ...]]
    price: tuple[float, float]


COLORS = ("black", "white", "navy blue", "grey", "beige", "olive green", "burgundy", "light pink")
SIZES = ("small", "medium", "large", "x-large", "xx-large")
SHOE_SIZES = ("6", "7", "8", "9", "10", "11", "12")

BEAUTY = ("Beauty & Personal Care",)
GROCERY = ("Grocery & Gourmet Food",)
FASHION = ("Clothing, Shoes & Jewelry",)
FURNITURE = ("Home & Kitchen", "Furniture")
HOME = ("Home & Kitchen",)
ELECTRONICS = ("Electronics",)

PRODUCT_TYPES: tuple[ProductType, ...] = (
    # --- beauty -------------------------------------------------------------------------------
    ProductType(
        "hair extensions",
        "beauty",
        (*BEAUTY, "Hair Care", "Hair Extensions"),
        ("hair", "extension"),
        (
            "natural looking",
            "clip in",
            "long lasting",
            "easy to apply",
            "heat resistant",
            "human hair",
            "high quality",
            "tangle free",
        ),
        {
            "size": ("14 inch", "18 inch", "22 inch", "26 inch"),
            "color": ("natural black", "dark brown", "ash blonde", "auburn", "honey blonde"),
        },
        (12.0, 89.0),
    ),
    ProductType(
        "shampoo",
        "beauty",
        (*BEAUTY, "Hair Care", "Shampoo & Conditioner"),
        ("shampoo",),
        (
            "sulfate free",
            "paraben free",
            "cruelty free",
            "natural ingredients",
            "for dry hair",
            "for damaged hair",
            "argan oil",
            "tea tree",
        ),
        {
            "size": ("8 fl oz", "16 fl oz", "32 fl oz"),
            "scent": ("unscented", "lavender", "citrus", "coconut"),
        },
        (5.0, 34.0),
    ),
    ProductType(
        "deodorant",
        "beauty",
        (*BEAUTY, "Personal Care", "Deodorants"),
        ("deodorant",),
        (
            "aluminum free",
            "long lasting",
            "travel size",
            "natural ingredients",
            "for sensitive skin",
            "baking soda free",
            "cruelty free",
        ),
        {
            "size": ("2.1 oz (pack of 1)", "2.6 oz (pack of 2)", "3 oz (pack of 3)"),
            "scent": ("unscented", "bright citrus", "cedar", "rose", "eucalyptus"),
        },
        (4.0, 29.0),
    ),
    ProductType(
        "lipstick",
        "beauty",
        (*BEAUTY, "Makeup", "Lips"),
        ("lipstick",),
        (
            "long lasting",
            "cruelty free",
            "paraben free",
            "matte finish",
            "moisturizing",
            "vegan",
            "waterproof",
        ),
        {"color": ("ruby red", "nude pink", "berry", "coral", "mauve", "plum")},
        (4.0, 32.0),
    ),
    ProductType(
        "face moisturizer",
        "beauty",
        (*BEAUTY, "Skin Care", "Face Moisturizers"),
        ("face", "moisturizer"),
        (
            "oil free",
            "dermatologist tested",
            "hyaluronic acid",
            "fragrance free",
            "for sensitive skin",
            "spf 30",
            "non comedogenic",
        ),
        {"size": ("1.7 oz", "2.5 oz", "3.4 oz")},
        (8.0, 58.0),
    ),
    ProductType(
        "nail polish",
        "beauty",
        (*BEAUTY, "Foot, Hand & Nail Care", "Nail Polish"),
        ("nail", "polish"),
        ("quick drying", "non toxic", "long lasting", "gel finish", "chip resistant", "vegan"),
        {
            "color": ("classic red", "baby pink", "midnight blue", "glitter gold", "clear", "lilac"),
            "size": ("0.5 fl oz", "0.5 fl oz (pack of 3)"),
        },
        (3.0, 24.0),
    ),
    ProductType(
        "makeup brush set",
        "beauty",
        (*BEAUTY, "Tools & Accessories", "Makeup Brushes"),
        ("makeup", "brush", "set"),
        (
            "synthetic bristles",
            "easy to clean",
            "travel size",
            "cruelty free",
            "with storage case",
            "soft bristles",
        ),
        {"size": ("5 piece", "10 piece", "15 piece"), "color": ("rose gold", "black", "marble white")},
        (7.0, 45.0),
    ),
    ProductType(
        "electric toothbrush",
        "beauty",
        (*BEAUTY, "Oral Care", "Power Toothbrushes"),
        ("electric", "toothbrush"),
        (
            "rechargeable",
            "waterproof",
            "with travel case",
            "2 minute timer",
            "for sensitive teeth",
            "long battery life",
        ),
        {"color": ("white", "black", "pink", "mint green"), "size": ("1 handle", "2 handles")},
        (15.0, 99.0),
    ),
    # --- grocery ------------------------------------------------------------------------------
    ProductType(
        "coffee beans",
        "grocery",
        (*GROCERY, "Beverages", "Coffee"),
        ("coffee", "beans"),
        ("fair trade", "organic", "dark roast", "medium roast", "whole bean", "low acid", "gluten free"),
        {"size": ("12 ounce", "2 pound", "5 pound"), "flavor": ("original", "vanilla", "hazelnut", "mocha")},
        (7.0, 49.0),
    ),
    ProductType(
        "protein bars",
        "grocery",
        (*GROCERY, "Snack Foods", "Protein Bars"),
        ("protein", "bars"),
        ("gluten free", "high protein", "low sugar", "keto friendly", "non gmo", "plant based"),
        {
            "flavor": ("chocolate chip", "peanut butter", "cookies and cream", "birthday cake"),
            "size": ("12 count", "24 count"),
        },
        (12.0, 44.0),
    ),
    ProductType(
        "herbal tea",
        "grocery",
        (*GROCERY, "Beverages", "Tea"),
        ("herbal", "tea"),
        ("caffeine free", "organic", "non gmo", "individually wrapped", "usda organic", "kosher"),
        {
            "flavor": ("chamomile", "peppermint", "ginger", "rooibos", "lemon balm"),
            "size": ("20 count", "40 count", "100 count"),
        },
        (4.0, 26.0),
    ),
    ProductType(
        "olive oil",
        "grocery",
        (*GROCERY, "Pantry Staples", "Oils"),
        ("olive", "oil"),
        ("extra virgin", "cold pressed", "organic", "non gmo", "kosher", "single origin"),
        {"size": ("16.9 fl oz", "33.8 fl oz", "1 gallon")},
        (8.0, 52.0),
    ),
    ProductType(
        "dark chocolate",
        "grocery",
        (*GROCERY, "Candy & Chocolate", "Chocolate Bars"),
        ("chocolate",),
        ("sugar free", "dairy free", "vegan", "fair trade", "gluten free", "70% cacao"),
        {
            "flavor": ("sea salt", "almond", "orange", "mint", "raspberry"),
            "size": ("3.5 ounce (pack of 4)", "3.5 ounce (pack of 12)"),
        },
        (6.0, 38.0),
    ),
    ProductType(
        "trail mix",
        "grocery",
        (*GROCERY, "Snack Foods", "Trail Mix"),
        ("trail", "mix"),
        ("non gmo", "gluten free", "no artificial flavors", "resealable bag", "high protein", "kosher"),
        {
            "flavor": ("classic", "tropical", "dark chocolate cherry", "honey nut"),
            "size": ("1.5 ounce (pack of 12)", "26 ounce", "3 pound"),
        },
        (6.0, 33.0),
    ),
    ProductType(
        "beef jerky",
        "grocery",
        (*GROCERY, "Meat & Seafood", "Jerky"),
        ("beef", "jerky"),
        ("high protein", "low fat", "gluten free", "no preservatives", "grass fed", "keto friendly"),
        {
            "flavor": ("original", "teriyaki", "peppered", "sweet and spicy"),
            "size": ("2.85 ounce", "10 ounce", "16 ounce"),
        },
        (6.0, 42.0),
    ),
    ProductType(
        "sparkling water",
        "grocery",
        (*GROCERY, "Beverages", "Sparkling Water"),
        ("sparkling", "water"),
        ("zero calorie", "sugar free", "non gmo", "bpa free", "naturally flavored"),
        {
            "flavor": ("lime", "grapefruit", "black cherry", "mango", "pure"),
            "size": ("12 fl oz (pack of 12)", "12 fl oz (pack of 24)"),
        },
        (5.0, 29.0),
    ),
    # --- fashion ------------------------------------------------------------------------------
    ProductType(
        "running shoes",
        "fashion",
        (*FASHION, "Men", "Shoes", "Athletic"),
        ("running", "shoes"),
        (
            "lightweight",
            "non slip",
            "breathable",
            "memory foam",
            "arch support",
            "machine washable",
            "rubber sole",
        ),
        {"size": SHOE_SIZES, "color": ("black", "white", "navy blue", "grey", "red")},
        (24.0, 129.0),
    ),
    ProductType(
        "women's jumpsuit",
        "fashion",
        (*FASHION, "Women", "Clothing", "Jumpsuits, Rompers & Overalls"),
        ("jumpsuit",),
        (
            "slim fit",
            "machine wash",
            "short sleeve",
            "high waist",
            "polyester spandex",
            "for daily wear",
            "wide leg",
        ),
        {"size": SIZES, "color": ("green stripe", "black", "wine red", "khaki", "floral blue")},
        (16.0, 59.0),
    ),
    ProductType(
        "men's dress shirt",
        "fashion",
        (*FASHION, "Men", "Clothing", "Shirts"),
        ("dress", "shirt"),
        ("slim fit", "wrinkle free", "long sleeve", "button down", "machine wash", "100% cotton"),
        {"size": SIZES, "color": ("white", "light blue", "pink", "black", "lavender")},
        (14.0, 69.0),
    ),
    ProductType(
        "yoga pants",
        "fashion",
        (*FASHION, "Women", "Clothing", "Active", "Leggings"),
        ("yoga", "pants"),
        (
            "high waist",
            "tummy control",
            "moisture wicking",
            "four way stretch",
            "squat proof",
            "with pockets",
        ),
        {"size": SIZES, "color": ("black", "charcoal", "navy blue", "dusty rose", "olive green")},
        (12.0, 49.0),
    ),
    ProductType(
        "winter jacket",
        "fashion",
        (*FASHION, "Men", "Clothing", "Jackets & Coats"),
        ("winter", "jacket"),
        ("water resistant", "hooded", "fleece lined", "windproof", "zip closure", "packable"),
        {"size": SIZES, "color": ("black", "army green", "navy blue", "camel", "red")},
        (35.0, 189.0),
    ),
    ProductType(
        "leather wallet",
        "fashion",
        (*FASHION, "Men", "Accessories", "Wallets"),
        ("leather", "wallet"),
        ("rfid blocking", "genuine leather", "slim design", "with gift box", "bifold", "with coin pocket"),
        {"color": ("black", "brown", "tan", "navy blue")},
        (9.0, 59.0),
    ),
    ProductType(
        "sunglasses",
        "fashion",
        (*FASHION, "Accessories", "Sunglasses & Eyewear"),
        ("sunglasses",),
        ("polarized", "uv protection", "lightweight frame", "unisex", "scratch resistant"),
        {"color": ("black frame", "tortoise", "gold frame", "clear frame", "blue mirror")},
        (8.0, 79.0),
    ),
    ProductType(
        "wool socks",
        "fashion",
        (*FASHION, "Men", "Clothing", "Socks"),
        ("wool", "socks"),
        ("moisture wicking", "cushioned sole", "breathable", "merino wool", "for hiking", "seamless toe"),
        {"size": ("small", "medium", "large"), "color": ("grey", "charcoal", "navy blue", "multicolor")},
        (9.0, 39.0),
    ),
    # --- furniture / home ---------------------------------------------------------------------
    ProductType(
        "office chair",
        "furniture",
        (*FURNITURE, "Home Office Furniture", "Home Office Chairs"),
        ("office", "chair"),
        (
            "ergonomic design",
            "lumbar support",
            "adjustable height",
            "easy assembly",
            "high back",
            "breathable mesh",
            "with armrests",
        ),
        {"color": ("black", "grey", "white", "blue")},
        (49.0, 299.0),
    ),
    ProductType(
        "bookshelf",
        "furniture",
        (*FURNITURE, "Living Room Furniture", "Bookcases"),
        ("bookshelf",),
        ("easy assembly", "solid wood", "space saving", "5 tier", "industrial style", "anti tip"),
        {"color": ("rustic brown", "white", "black oak", "walnut")},
        (39.0, 199.0),
    ),
    ProductType(
        "coffee table",
        "furniture",
        (*FURNITURE, "Living Room Furniture", "Tables"),
        ("coffee", "table"),
        ("easy assembly", "with storage shelf", "solid wood", "mid century", "for living room", "lift top"),
        {"color": ("walnut", "white", "black", "natural oak"), "size": ("39 inch", "43 inch", "47 inch")},
        (59.0, 259.0),
    ),
    ProductType(
        "bed frame",
        "furniture",
        (*FURNITURE, "Bedroom Furniture", "Beds & Frames"),
        ("bed", "frame"),
        (
            "easy assembly",
            "noise free",
            "metal platform",
            "under bed storage",
            "no box spring needed",
            "with headboard",
        ),
        {"size": ("twin", "full", "queen", "king"), "color": ("black", "white", "grey", "brown")},
        (79.0, 349.0),
    ),
    ProductType(
        "throw pillow covers",
        "furniture",
        (*HOME, "Home Decor", "Throw Pillow Covers"),
        ("pillow", "covers"),
        ("machine washable", "hidden zipper", "soft velvet", "set of 2", "for living room", "linen"),
        {"size": ("16 x 16 inch", "18 x 18 inch", "20 x 20 inch"), "color": COLORS[:6]},
        (6.0, 29.0),
    ),
    ProductType(
        "floor lamp",
        "furniture",
        (*HOME, "Lighting & Ceiling Fans", "Floor Lamps"),
        ("floor", "lamp"),
        (
            "dimmable",
            "energy efficient",
            "led bulb included",
            "for living room",
            "easy assembly",
            "remote control",
        ),
        {"color": ("black", "brass", "white", "silver")},
        (25.0, 159.0),
    ),
    ProductType(
        "area rug",
        "furniture",
        (*HOME, "Home Decor", "Area Rugs"),
        ("area", "rug"),
        ("non slip", "machine washable", "stain resistant", "for living room", "soft touch", "low pile"),
        {
            "size": ("3 x 5 ft", "5 x 7 ft", "8 x 10 ft"),
            "color": ("grey", "beige", "navy blue", "multicolor"),
        },
        (19.0, 229.0),
    ),
    ProductType(
        "shower curtain",
        "furniture",
        (*HOME, "Bath", "Shower Curtains"),
        ("shower", "curtain"),
        ("waterproof", "machine washable", "rust proof hooks", "mildew resistant", "weighted hem"),
        {"size": ("72 x 72 inch", "72 x 84 inch"), "color": ("white", "grey", "sage green", "blue")},
        (9.0, 39.0),
    ),
    # --- electronics --------------------------------------------------------------------------
    ProductType(
        "wireless earbuds",
        "electronics",
        (*ELECTRONICS, "Headphones", "Earbud Headphones"),
        ("earbuds",),
        (
            "noise cancelling",
            "bluetooth 5.3",
            "long battery life",
            "waterproof",
            "fast charging",
            "touch control",
        ),
        {"color": ("black", "white", "navy blue", "rose gold")},
        (15.0, 149.0),
    ),
    ProductType(
        "phone case",
        "electronics",
        (*ELECTRONICS, "Cell Phones & Accessories", "Cases"),
        ("phone", "case"),
        (
            "shockproof",
            "wireless charging compatible",
            "slim fit",
            "with screen protector",
            "drop protection",
            "clear back",
        ),
        {
            "color": ("black", "clear", "navy blue", "pink", "green"),
            "size": ("iphone 14", "iphone 15", "galaxy s23", "pixel 8"),
        },
        (6.0, 39.0),
    ),
    ProductType(
        "usb c charger",
        "electronics",
        (*ELECTRONICS, "Accessories & Supplies", "Chargers"),
        ("usb", "charger"),
        ("fast charging", "compact design", "dual port", "foldable plug", "overheat protection"),
        {"size": ("20w", "35w", "65w", "100w"), "color": ("white", "black")},
        (9.0, 59.0),
    ),
    ProductType(
        "hdmi cable",
        "electronics",
        (*ELECTRONICS, "Accessories & Supplies", "Cables"),
        ("hdmi", "cable"),
        ("4k 60hz", "high speed", "braided", "gold plated", "8k ready"),
        {"size": ("3 ft", "6 ft", "10 ft", "15 ft"), "color": ("black", "grey")},
        (5.0, 29.0),
    ),
    ProductType(
        "portable speaker",
        "electronics",
        (*ELECTRONICS, "Portable Audio & Video", "Speakers"),
        ("speaker",),
        ("waterproof", "bluetooth", "long battery life", "deep bass", "for outdoor", "built in microphone"),
        {"color": ("black", "blue", "red", "camo green")},
        (19.0, 179.0),
    ),
    ProductType(
        "smart watch",
        "electronics",
        (*ELECTRONICS, "Wearable Technology", "Smartwatches"),
        ("smart", "watch"),
        ("heart rate monitor", "sleep tracking", "waterproof", "long battery life", "fitness tracker", "gps"),
        {"color": ("black", "silver", "rose gold", "midnight blue"), "size": ("40mm", "44mm")},
        (29.0, 249.0),
    ),
    ProductType(
        "laptop stand",
        "electronics",
        (*ELECTRONICS, "Computers & Accessories", "Laptop Stands"),
        ("laptop", "stand"),
        ("height adjustable", "aluminum alloy", "foldable", "heat dissipation", "portable", "non slip"),
        {"color": ("silver", "space grey", "black")},
        (14.0, 69.0),
    ),
    ProductType(
        "power bank",
        "electronics",
        (*ELECTRONICS, "Cell Phones & Accessories", "Portable Power Banks"),
        ("power", "bank"),
        ("fast charging", "high capacity", "usb c", "compact design", "led display", "airline approved"),
        {"size": ("10000mah", "20000mah", "26800mah"), "color": ("black", "white", "blue")},
        (15.0, 79.0),
    ),
)

# Made-up brand names, eight per category, so that no title names a real company.
BRANDS: dict[str, tuple[str, ...]] = {
    "beauty": ("Lumora", "Velisse", "Bloome", "Naturwell", "Serenova", "Aurelle", "Purezza", "Mirave"),
    "grocery": (
        "Harvest Lane",
        "Golden Acre",
        "Kinfolk Pantry",
        "Sunmead",
        "Brookvale",
        "Orchard & Oak",
        "Terra Verde",
        "Wildgrain",
    ),
    "fashion": (
        "Northpeak",
        "Urban Drift",
        "Maison Lune",
        "Stridewell",
        "Kestrel",
        "Everthread",
        "Copper Fox",
        "Solstice",
    ),
    "furniture": (
        "Oakhaven",
        "Nordvik",
        "Loftline",
        "Hearthstone",
        "Willow & Pine",
        "Casaluna",
        "Brixton Home",
        "Mossgrove",
    ),
    "electronics": ("Voltix", "Sonaro", "Nexacore", "Pulsewave", "Ampliq", "Zentro", "Lumitek", "Orbisound"),
}

# Words a title puts around the type (one of each at most), so titles of one type differ.
TITLE_STYLES = ("Premium", "Classic", "Essential", "Pro", "Everyday", "Signature", "Deluxe", "Original")
REVIEW_LINES = (
    "Exactly as described, would buy again.",
    "Good value for the price.",
    "Arrived quickly and works as expected.",
    "Quality is better than I thought it would be.",
    "Not bad, but the color was a little different from the picture.",
    "My second order, still happy with it.",
    "Does the job. Packaging could be better.",
    "Great gift, my family loved it.",
)
