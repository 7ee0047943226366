"""Small built-in tasks (datasets + reward functions) for the quickstart and tests."""
