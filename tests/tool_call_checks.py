"""What the tool-call tests share: two function tools as the `openai` client makes them from pydantic models, a
question that calls both, and OpenAI's streaming shape of tool-call deltas."""
import openai
import pydantic


class GetWeather(pydantic.BaseModel):
    city: str
    days: int


class GetTime(pydantic.BaseModel):
    zone: str


TOOLS = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]
ASK = [{"role": "user", "content": "Weather in Paris for 2 days, and the time in CET?"}]


def check_stream_shape(deltas: list[dict]) -> None:
    """OpenAI's streaming shape: each call opens with index, id, type, name and arguments "", then fragments."""
    seen = set()
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"})
        for entry in d.get("tool_calls", []):
            if entry["index"] not in seen:
                call_id = entry["id"]  # Mistral's are 9 letters and digits, as vLLM's
                assert call_id.startswith("call_") or (call_id.isalnum() and len(call_id) == 9), call_id
                assert entry["index"] == len(seen) and entry["type"] == "function"
                assert entry["function"]["arguments"] == "" and entry["function"]["name"]
                seen.add(entry["index"])
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
