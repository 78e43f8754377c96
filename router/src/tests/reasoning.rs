//! `--reasoning-parser` through the routes: the reasoning split from the answer the
//! same whole and streamed, the template's `enable_thinking` from `chat_template_kwargs`
//! and from Anthropic's `thinking`, and nothing changed without the flag.

use super::*;
use crate::reasoning::ReasoningParser;

/// Opens the assistant's reasoning unless `enable_thinking` is false, when it writes
/// the empty block (Qwen3's way to turn thinking off).
const THINKING_TEMPLATE: &str = "{% for m in messages %}{{ m.content }};{% endfor %}{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}";

const OUTPUT: &str = "So 2<3.</think>\nIt é.";
const REASONING: &str = "So 2<3.";
const CONTENT: &str = "\nIt é.";

fn thinking_harness(parser: Option<ReasoningParser>) -> Harness {
    let mut script = ids(OUTPUT);
    script.push(testing::eos_id());
    let mut setup = setup(Script::Fixed(script)).chat_template_source(THINKING_TEMPLATE);
    if let Some(parser) = parser {
        setup = setup.reasoning_parser(parser);
    }
    setup.build()
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "q"}], "max_tokens": 24});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// A streamed chat answer's reasoning, `reasoning_content` and content, added up.
fn streamed_message(chunks: &[Value]) -> (String, String, String) {
    let (mut reasoning, mut older, mut content) = (String::new(), String::new(), String::new());
    for chunk in chunks {
        let Some(delta) = chunk["choices"].get(0).map(|c| &c["delta"]) else {
            continue;
        };
        reasoning.push_str(delta["reasoning"].as_str().unwrap_or_default());
        older.push_str(delta["reasoning_content"].as_str().unwrap_or_default());
        content.push_str(delta["content"].as_str().unwrap_or_default());
    }
    (reasoning, older, content)
}

#[tokio::test]
async fn chat_reasoning_is_split_from_the_content_whole_and_streamed() {
    let h = thinking_harness(Some(ReasoningParser::Qwen3));
    let (status, v) = h.post("/v1/chat/completions", chat(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let message = &v["choices"][0]["message"];
    assert_eq!(message["reasoning"], REASONING, "{v}");
    assert_eq!(message["reasoning_content"], REASONING);
    assert_eq!(message["content"], CONTENT);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let (_, chunks) =
        openai_stream(&h, "/v1/chat/completions", chat(json!({"stream": true}))).await;
    let (reasoning, older, content) = streamed_message(&chunks);
    assert_eq!(reasoning, REASONING);
    assert_eq!(older, reasoning);
    assert_eq!(content, CONTENT);
    // No chunk carries both, and every reasoning chunk comes before the content.
    let kinds: Vec<&str> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .filter_map(|c| {
            let d = &c["delta"];
            match (d.get("reasoning"), d["content"].as_str()) {
                (Some(_), Some(_)) => panic!("both in one delta: {c}"),
                (Some(_), None) => Some("r"),
                (None, Some(text)) if !text.is_empty() => Some("c"),
                _ => None,
            }
        })
        .collect();
    let first_content = kinds.iter().position(|k| *k == "c").unwrap();
    assert!(
        kinds[first_content..].iter().all(|k| *k == "c"),
        "{kinds:?}"
    );
    // include_reasoning: false drops it.
    let (_, v) = h
        .post(
            "/v1/chat/completions",
            chat(json!({"include_reasoning": false})),
        )
        .await;
    assert!(v["choices"][0]["message"].get("reasoning").is_none(), "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], CONTENT);
    h.assert_protocol_ok();
}

#[tokio::test]
async fn chat_template_kwargs_reach_the_template_and_thinking_off_is_all_content() {
    let h = thinking_harness(Some(ReasoningParser::Qwen3));
    let off = json!({"chat_template_kwargs": {"enable_thinking": false}});
    let (status, v) = h.post("/v1/chat/completions", chat(off.clone())).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let message = &v["choices"][0]["message"];
    assert!(message.get("reasoning").is_none(), "{v}");
    assert_eq!(message["content"], OUTPUT);
    // The prompt had the empty block: more tokens than the opened one.
    let (_, on) = h.post("/v1/chat/completions", chat(json!({}))).await;
    let tokens = |v: &Value| v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(tokens(&v) - tokens(&on), "</think>".len() as u64);
    let bad = json!({"reasoning_effort": "max"});
    let (status, v) = h.post("/v1/chat/completions", chat(bad)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["param"], "reasoning_effort");
    let (status, _) = h
        .post(
            "/v1/chat/completions",
            chat(json!({"reasoning_effort": "low"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    h.assert_protocol_ok();
}

#[tokio::test]
async fn a_structured_output_is_all_answer_even_after_an_opened_think() {
    let json_text = "{\"a\": 1}";
    let mut script = ids(json_text);
    script.push(testing::eos_id());
    let h = setup(Script::Fixed(script))
        .chat_template_source(THINKING_TEMPLATE)
        .reasoning_parser(ReasoningParser::DeepseekR1)
        .build();
    let format = json!({"response_format": {"type": "json_object"}});
    let (status, v) = h.post("/v1/chat/completions", chat(format)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let message = &v["choices"][0]["message"];
    assert_eq!(message["content"], json_text, "{v}");
    assert!(message.get("reasoning").is_none(), "{v}");
    h.assert_protocol_ok();
}

#[tokio::test]
async fn without_a_parser_the_answer_is_the_text_as_generated() {
    let h = thinking_harness(None);
    let (_, v) = h.post("/v1/chat/completions", chat(json!({}))).await;
    let message = &v["choices"][0]["message"];
    assert_eq!(message["content"], OUTPUT, "{v}");
    assert!(message.get("reasoning").is_none() && message.get("reasoning_content").is_none());
    let (_, chunks) =
        openai_stream(&h, "/v1/chat/completions", chat(json!({"stream": true}))).await;
    assert_eq!(
        streamed_message(&chunks),
        (String::new(), String::new(), OUTPUT.into())
    );
    let body = json!({"max_tokens": 24, "messages": [{"role": "user", "content": "q"}]});
    let (_, v) = h.post("/v1/messages", body).await;
    assert_eq!(
        v["content"],
        json!([{"type": "text", "text": OUTPUT}]),
        "{v}"
    );
    h.assert_protocol_ok();
}

#[tokio::test]
async fn anthropic_thinking_maps_to_enable_thinking_and_reasoning_is_a_thinking_block() {
    let h = thinking_harness(Some(ReasoningParser::DeepseekR1));
    let body = |thinking: Value| {
        json!({"max_tokens": 24, "thinking": thinking,
               "messages": [{"role": "user", "content": "q"},
                            {"role": "assistant", "content": [
                                {"type": "thinking", "thinking": "o", "signature": "s"},
                                {"type": "text", "text": "y"}]},
                            {"role": "user", "content": "s"}]})
    };
    let (status, v) = h
        .post(
            "/v1/messages",
            body(json!({"type": "enabled", "budget_tokens": 1024})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(
        v["content"],
        json!([{"type": "thinking", "thinking": REASONING, "signature": ""},
               {"type": "text", "text": CONTENT}])
    );
    let (_, v) = h
        .post("/v1/messages", body(json!({"type": "disabled"})))
        .await;
    assert_eq!(
        v["content"],
        json!([{"type": "text", "text": OUTPUT}]),
        "{v}"
    );
    let (status, v) = h
        .post("/v1/messages", body(json!({"type": "sometimes"})))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert!(v.to_string().contains("thinking.type"), "{v}");
    h.assert_protocol_ok();
}
