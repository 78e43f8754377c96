//! Tool calling on chat completions: calls read back alike whole and streamed, cut
//! calls, and errors naming their field.

use super::*;

/// A call as the model writes it, and a chat template short enough for it to fit the
/// test model's 64 tokens: it reads `tools` (so it has a tool section and no tool
/// prompt is added) and renders the last message's text alone.
pub(super) const TOOL_CALL: &str = "<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call>";
pub(super) const TOOL_TEMPLATE: &str = "{% if tools %}{% endif %}{{ messages[-1].content }}";

fn tool_request(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// One streamed chat choice put back together.
#[derive(Clone, Default)]
struct StreamedChat {
    content: String,
    /// (id, name, arguments)
    calls: Vec<(String, String, String)>,
    /// Only the last chunk of a choice carries it.
    finish_reason: Value,
}

fn streamed_chat(chunks: &[Value]) -> Vec<StreamedChat> {
    let mut choices: Vec<StreamedChat> = Vec::new();
    for choice in chunks.iter().flat_map(|c| c["choices"].as_array().unwrap()) {
        let index = choice["index"].as_u64().unwrap() as usize;
        if choices.len() <= index {
            choices.resize(index + 1, StreamedChat::default());
        }
        let streamed = &mut choices[index];
        assert!(
            streamed.finish_reason.is_null(),
            "a chunk after the finish reason: {choice}"
        );
        streamed.finish_reason = choice["finish_reason"].clone();
        if let Some(text) = choice["delta"]["content"].as_str() {
            streamed.content.push_str(text);
        }
        for call in choice["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let k = call["index"].as_u64().unwrap() as usize;
            if let Some(id) = call["id"].as_str() {
                assert_eq!(k, streamed.calls.len(), "{call}");
                let name = call["function"]["name"].as_str().unwrap().to_string();
                streamed.calls.push((id.to_string(), name, String::new()));
            }
            let arguments = call["function"]["arguments"].as_str().unwrap();
            streamed.calls[k].2.push_str(arguments);
        }
    }
    choices
}

#[tokio::test]
async fn chat_tool_calls_are_read_back_alike_whole_and_streamed() {
    let mut script = ids(&format!("ok {TOOL_CALL}"));
    script.push(testing::eos_id());
    let h = setup(Script::Fixed(script))
        .chat_template_source(TOOL_TEMPLATE)
        .build();
    let (status, v) = h
        .post("/v1/chat/completions", tool_request(json!({"n": 2})))
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    for (i, choice) in v["choices"].as_array().unwrap().iter().enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(choice["finish_reason"], "tool_calls", "{choice}");
        let message = &choice["message"];
        assert_eq!(message["content"], "ok");
        let calls = message["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["type"], "function");
        assert_eq!(
            calls[0]["function"],
            json!({"name": "f", "arguments": "{}"})
        );
        assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    }
    let body = tool_request(json!({"n": 2, "stream": true}));
    let (_, chunks) = openai_stream(&h, "/v1/chat/completions", body).await;
    let choices = streamed_chat(&chunks);
    assert_eq!(choices.len(), 2);
    for choice in choices {
        assert_eq!(choice.content, "ok");
        let [(id, name, arguments)] = choice.calls.as_slice() else {
            panic!("one call: {:?}", choice.calls);
        };
        assert!(id.starts_with("call_"));
        assert_eq!((name.as_str(), arguments.as_str()), ("f", "{}"));
        assert_eq!(choice.finish_reason, "tool_calls");
    }
    // A named function ends with "stop", as OpenAI's.
    let named = json!({"tool_choice": {"type": "function", "function": {"name": "f"}}});
    let (_, v) = h.post("/v1/chat/completions", tool_request(named)).await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
        "f"
    );
    h.assert_protocol_ok();
}

#[tokio::test]
async fn a_chat_tool_call_cut_short_is_content_and_none_leaves_the_text_alone() {
    let mut script = ids(TOOL_CALL);
    script.push(testing::eos_id());
    let h = setup(Script::Fixed(script))
        .chat_template_source(TOOL_TEMPLATE)
        .build();
    let cut = testing::tokenizer().decode(&ids(TOOL_CALL)[..20]);
    for stream in [false, true] {
        let body = tool_request(json!({"max_tokens": 20, "stream": stream}));
        let choice = if stream {
            let (_, chunks) = openai_stream(&h, "/v1/chat/completions", body).await;
            streamed_chat(&chunks).remove(0)
        } else {
            let (status, v) = h.post("/v1/chat/completions", body).await;
            assert_eq!(status, StatusCode::OK, "{v}");
            let choice = &v["choices"][0];
            assert!(choice["message"].get("tool_calls").is_none(), "{v}");
            StreamedChat {
                content: choice["message"]["content"].as_str().unwrap().to_string(),
                calls: Vec::new(),
                finish_reason: choice["finish_reason"].clone(),
            }
        };
        assert_eq!(choice.content, cut, "stream: {stream}");
        assert!(choice.calls.is_empty());
        assert_eq!(choice.finish_reason, "length");
    }
    let (_, v) = h
        .post(
            "/v1/chat/completions",
            tool_request(json!({"tool_choice": "none"})),
        )
        .await;
    assert_eq!(v["choices"][0]["message"]["content"], TOOL_CALL, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    h.assert_protocol_ok();
}

#[tokio::test]
async fn chat_tool_errors_name_their_field() {
    let h = setup(Script::Hash)
        .chat_template_source(TOOL_TEMPLATE)
        .build();
    let history = json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "1"}
    ]});
    let cases = [
        (
            tool_request(json!({"tools": [{"type": "function", "function": {"name": "a b"}}]})),
            "tools[0].function.name",
        ),
        (
            tool_request(json!({"response_format": {"type": "json_object"}})),
            "response_format",
        ),
        (
            tool_request(json!({"tool_choice": "sometimes"})),
            "tool_choice",
        ),
        (
            json!({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}),
            "tool_choice",
        ),
        (
            tool_request(history),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            tool_request(json!({"functions": [{"name": "f"}]})),
            "functions",
        ),
    ];
    for (body, param) in cases {
        let (status, v) = h.post("/v1/chat/completions", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    // With tool_choice "none", response_format applies and the tools only reach the
    // template.
    let body = tool_request(json!({"tool_choice": "none",
        "response_format": {"type": "json_object"}, "max_tokens": 2}));
    let (status, v) = h.post("/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    h.assert_protocol_ok();
}
