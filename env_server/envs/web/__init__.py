"""The web family: a WebShop-style shop served as real HTML that an agent shops in by text."""
