"""A tiny stand-in for a reasoning parser (jaxserve.openai.reasoning's interface, written in another branch of issue
52): `<think>...</think>` split off the front of the text as it streams; the reasoning is held until its end tag."""


class FakeThink:
    def __init__(self):
        self.held, self.ended = "", False

    def feed(self, text: str) -> tuple[str, str]:
        """-> (new reasoning text, new answer text)."""
        if self.ended:
            return "", text
        self.held += text
        if "</think>" not in self.held:
            return "", ""
        thought, _, answer = self.held.partition("</think>")
        self.held, self.ended = "", True
        return thought.removeprefix("<think>"), answer

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        return held.removeprefix("<think>"), ""
