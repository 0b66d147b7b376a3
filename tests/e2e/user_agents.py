"""User agent functions loaded by import path in the e2e tests (`user_agents:NAME`)."""

from rl3d.agents.examples import calculator_agent


def calculator_after_a_side_question(client, sample):
    """The first sample of a prompt first asks the bare question on its own (a completion its
    episode does not extend), then every sample runs the calculator episode."""
    if sample["sample_index"] == 0:
        client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": sample["prompt"]}]
        )
    return calculator_agent(client, sample)
