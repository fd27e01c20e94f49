"""vLLM's routes beside the OpenAI API, over real HTTP: /tokenize and /detokenize (the
gateway's tokenizer, no job, behind a key), /version, /v1/models' vLLM fields."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.conftest import MODEL, Stack, run_stack
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.engines.sim import SimEngine, SimTokenizer
from tokenyard.gateway.auth import KeyRing, Tenant

KEY = "sk-tokenize"


def test_tokenize_a_prompt_counts_what_its_job_gets(stack: Stack) -> None:
    tok = SimTokenizer()
    with stack.client() as http:
        r = http.post("/tokenize", json={"model": MODEL, "prompt": "héllo"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens"] == tok.encode("héllo")
        assert body["count"] == len(body["tokens"]) == 6
        assert body["max_model_len"] == tok.max_model_len
        assert body["token_strs"] is None
        # no model named: the one served; the pieces as asked
        r = http.post("/tokenize", json={"prompt": "ab", "return_token_strs": True})
        assert r.json()["token_strs"] == ["a", "b"]
        # the job of the same prompt counts the same prompt tokens
        done = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "héllo", "max_tokens": 2}
        )
        assert done.json()["usage"]["prompt_tokens"] == body["count"]
    assert stack.job_ids() == [done.headers["x-job-id"]]  # /tokenize made no job


def test_tokenize_messages_renders_the_chat_template(stack: Stack) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with stack.client() as http:
        r = http.post("/tokenize", json={"model": MODEL, "messages": messages})
        assert r.status_code == 200, r.text
        prompt = SimTokenizer().apply_chat_template(messages)
        assert r.json()["tokens"] == SimTokenizer().encode(prompt)
        chat = http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1}
        )
        assert chat.json()["usage"]["prompt_tokens"] == r.json()["count"]
        # vLLM's template switches and variables render as a chat completion's prompt does
        tok = SimTokenizer()
        for extra, rendered in (
            (
                {"add_generation_prompt": False},
                tok.apply_chat_template(messages, None, None, add_generation_prompt=False),
            ),
            (
                {"add_generation_prompt": False, "continue_final_message": True},
                tok.apply_chat_template(
                    messages, None, None, add_generation_prompt=False, continue_final_message=True
                ),
            ),
            (
                {"chat_template_kwargs": {"enable_thinking": False}},
                tok.apply_chat_template(messages, None, {"enable_thinking": False}),
            ),
        ):
            r = http.post("/tokenize", json={"model": MODEL, "messages": messages, **extra})
            assert r.status_code == 200, (extra, r.text)
            assert r.json()["tokens"] == tok.encode(rendered), extra
            assert rendered != prompt  # each switch shows in the tokens
        # a request's own template is refused where the server does not trust them (as a chat
        # completion's is), and so are contradictions and what is not implemented
        for extra, param in (
            ({"chat_template": "{{ x }}"}, "chat_template"),
            ({"continue_final_message": True}, "continue_final_message"),
            ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
            ({"mm_processor_kwargs": {"a": 1}}, "mm_processor_kwargs"),
            ({"bogus": 1}, "bogus"),
        ):
            r = http.post("/tokenize", json={"model": MODEL, "messages": messages, **extra})
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == param


def test_tokenize_renders_a_trusted_request_template(valkey: EmbeddedServer) -> None:
    """With request templates trusted, /tokenize renders the request's own template (and its
    variables) to the same prompt tokens as the chat completion that sends it."""
    template = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{{ greeting }}"
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template": template,
        "chat_template_kwargs": {"greeting": "hello!"},
    }
    tok = SimTokenizer()
    with run_stack(valkey, trust_request_chat_template=True) as stack, stack.client() as http:
        r = http.post("/tokenize", json=ask)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tok.encode("[user:hi]hello!")
        chat = http.post("/v1/chat/completions", json={**ask, "max_tokens": 1})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == r.json()["count"]
        # a template that does not render is the request's fault, named
        r = http.post("/tokenize", json={**ask, "chat_template": "{% if %}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_detokenize_and_its_refusals(stack: Stack) -> None:
    tok = SimTokenizer()
    with stack.client() as http:
        r = http.post("/detokenize", json={"model": MODEL, "tokens": tok.encode("queue")})
        assert r.status_code == 200, r.text
        assert r.json() == {"prompt": "queue"}
        r = http.post("/detokenize", json={"model": MODEL, "tokens": [tok.vocab_size]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        r = http.post("/detokenize", json={"model": "nope", "tokens": [5]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = http.post("/tokenize", json={"model": MODEL})
        assert r.status_code == 400


def test_version_and_models_carry_vllms_fields(stack: Stack) -> None:
    with stack.client() as http:
        assert http.get("/version").json() == {"version": __import__("tokenyard").__version__}
        card = http.get("/v1/models").json()["data"][0]
    assert card["id"] == MODEL and card["object"] == "model"
    assert card["root"] == MODEL and card["parent"] is None
    # the context the worker published (the sim engine's own)
    assert card["max_model_len"] == 4096
    assert card["permission"][0]["object"] == "model_permission"
    # the official client reads them as a model's extra fields
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0]
    assert model.model_extra is not None and model.model_extra["max_model_len"] == 4096


def test_tokenize_is_tenant_scoped(valkey: EmbeddedServer) -> None:
    keys = KeyRing({KEY: Tenant("t1")})
    with run_stack(valkey, keyring=keys) as stack, stack.client() as http:
        assert http.post("/tokenize", json={"prompt": "a"}).status_code == 401
        assert http.post("/detokenize", json={"tokens": [5]}).status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert http.post("/tokenize", json={"prompt": "a"}, headers=auth).status_code == 200


@pytest.mark.slow
def test_tokenize_on_the_tiny_models_own_tokenizer(valkey: EmbeddedServer) -> None:
    pytest.importorskip("transformers")
    from tokenyard.gateway.tokenizers import load_tokenizer

    tok = load_tokenizer("hf", "tiny")
    stack = run_stack(valkey, model="tiny", models=("tiny",), tokenizer=tok)
    with stack as running, running.client() as http:
        body = http.post(
            "/tokenize", json={"prompt": "The queue", "return_token_strs": True}
        ).json()
        assert body["tokens"] == tok.encode("The queue")
        pieces = tok.hf.convert_ids_to_tokens(body["tokens"])  # type: ignore[attr-defined]
        assert body["token_strs"] == pieces
        bare = http.post(
            "/tokenize", json={"prompt": "The queue", "add_special_tokens": False}
        ).json()
        hf = tok.hf  # type: ignore[attr-defined]
        assert bare["tokens"] == hf.encode("The queue", add_special_tokens=False)
        text = http.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
        assert text == "The queue"
        # special tokens shown, as vLLM's /detokenize shows them
        bos = hf.convert_tokens_to_ids("<|bos|>")
        text = http.post("/detokenize", json={"tokens": [bos, *body["tokens"]]}).json()["prompt"]
        assert text == "<|bos|>The queue"


def test_cached_prompt_tokens_are_reported_in_usage(valkey: EmbeddedServer) -> None:
    def caching() -> SimEngine:
        return SimEngine(
            prefill_base=0.001,
            prefill_per_token=0.0,
            decode_base=0.002,
            decode_per_seq=0.0,
            prefix_cache_tokens=4096,
        )

    with run_stack(valkey, engines=[caching]) as stack:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "a long shared system prompt " * 8}]

        def ask() -> openai.types.CompletionUsage:
            out = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=2, extra_body={"cache": False}
            )
            assert out.usage is not None
            return out.usage

        first, second = ask(), ask()
        assert first.prompt_tokens_details is not None
        assert first.prompt_tokens_details.cached_tokens == 0
        assert second.prompt_tokens_details is not None
        # the sim's prefix cache holds whole 16-token blocks of the same prompt
        cached = second.prompt_tokens_details.cached_tokens
        assert cached == second.prompt_tokens // 16 * 16 > 0
    # an engine that does not say leaves the details out, as before
    with run_stack(valkey) as stack, stack.client() as http:
        usage = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}
        ).json()["usage"]
        assert "prompt_tokens_details" not in usage
