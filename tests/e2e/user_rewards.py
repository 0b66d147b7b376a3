"""User reward functions loaded by import path in the e2e tests (`user_rewards:NAME`)."""


def raise_on_index_3(inp):
    if inp.prompt_index == 3:
        raise ZeroDivisionError("user reward blew up")
    return float(len(inp.response_ids) > 0)


def count_words(inp):
    return min(1.0, len(inp.response_text.split()) / 8)
