//! One answer as Anthropic's SSE events (`event: <type>` and the JSON): `message_start`
//! (no content yet), per block `content_block_start` / `content_block_delta` (text as
//! `text_delta`, a call's input as one `input_json_delta`) / `content_block_stop`, then
//! `message_delta` (stop reason, output tokens) and `message_stop`; with
//! --reasoning-parser a `thinking` block first (`thinking_delta`s); a failure after the
//! start as an `error` event. `Events` decides the blocks from the output as the chat
//! route's `StreamedAnswer` reads it, so the events add up to the non-streamed message.

use std::convert::Infallible;

use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, StreamExt};
use serde::Serialize;
use tokio_stream::wrappers::UnboundedReceiverStream;
use utoipa::ToSchema;

use super::answer::{stop_reason, Message, OutputBlock, StopReason};
use super::error::{AnthropicErrorDetail, MessagesError};
use crate::api::tools::{Piece, Reading, StreamedAnswer};
use crate::api::{ApiError, ParamNames};
use crate::infer::{End, Submitted};
use crate::reasoning::{Thinking, ThinkingStream};

#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamEvent {
    MessageStart {
        message: Message,
    },
    ContentBlockStart {
        index: usize,
        content_block: OutputBlock,
    },
    ContentBlockDelta {
        index: usize,
        delta: BlockDelta,
    },
    ContentBlockStop {
        index: usize,
    },
    MessageDelta {
        delta: MessageDeltaBody,
        usage: OutputUsage,
    },
    MessageStop,
    Error {
        error: AnthropicErrorDetail,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BlockDelta {
    ThinkingDelta { thinking: String },
    TextDelta { text: String },
    InputJsonDelta { partial_json: String },
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct MessageDeltaBody {
    pub stop_reason: StopReason,
    pub stop_sequence: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct OutputUsage {
    pub output_tokens: usize,
}

impl StreamEvent {
    fn name(&self) -> &'static str {
        match self {
            Self::MessageStart { .. } => "message_start",
            Self::ContentBlockStart { .. } => "content_block_start",
            Self::ContentBlockDelta { .. } => "content_block_delta",
            Self::ContentBlockStop { .. } => "content_block_stop",
            Self::MessageDelta { .. } => "message_delta",
            Self::MessageStop => "message_stop",
            Self::Error { .. } => "error",
        }
    }

    fn error(e: MessagesError) -> Self {
        Self::Error {
            error: e.body.error,
        }
    }

    fn sse(&self) -> Result<Event, Infallible> {
        let data = serde_json::to_string(self).unwrap_or_default();
        Ok(Event::default().event(self.name()).data(data))
    }
}

/// The events of one answer, as its tokens come.
pub(super) struct Events {
    /// Set when the model may call: the output is read for calls.
    answer: Option<StreamedAnswer>,
    /// Set when the reasoning is split from the answer.
    thinking: Option<ThinkingStream>,
    /// The index of the thinking block open now.
    open_thinking: Option<usize>,
    /// The index of the text block open now.
    open_text: Option<usize>,
    /// The next block's index.
    blocks: usize,
}

impl Events {
    pub(super) fn new(reading: Option<&Reading>, thinking: Option<&Thinking>) -> Self {
        Self {
            answer: reading.map(Reading::stream),
            thinking: thinking.map(Thinking::stream),
            open_thinking: None,
            open_text: None,
            blocks: 0,
        }
    }

    /// The events of the next token's `text`; with the last (`end`) the closing ones.
    pub(super) fn token(&mut self, text: &str, end: Option<&End>) -> Vec<StreamEvent> {
        let mut out = Vec::new();
        let text = match self.thinking.as_mut() {
            None => text.to_string(),
            Some(thinking) => {
                let parts = thinking.next(text, end.is_some());
                self.think(parts.reasoning, &mut out);
                parts.content
            }
        };
        if !text.is_empty() || end.is_some() {
            if let Some(index) = self.open_thinking.take() {
                out.push(StreamEvent::ContentBlockStop { index });
            }
        }
        let pieces = match self.answer.as_mut() {
            None => vec![Piece::Content(text)],
            Some(answer) => answer.pieces(&text, end.is_some()),
        };
        for piece in pieces {
            match piece {
                Piece::Content(text) if text.is_empty() => {}
                Piece::Content(text) => {
                    let index = match self.open_text {
                        Some(index) => index,
                        None => self.open(
                            OutputBlock::Text {
                                text: String::new(),
                            },
                            &mut out,
                        ),
                    };
                    self.open_text = Some(index);
                    let delta = BlockDelta::TextDelta { text };
                    out.push(StreamEvent::ContentBlockDelta { index, delta });
                }
                Piece::Call(call) => {
                    self.close_text(&mut out);
                    let (opening, partial_json) = OutputBlock::tool_use(call).streamed();
                    let index = self.open(opening, &mut out);
                    let delta = BlockDelta::InputJsonDelta { partial_json };
                    out.push(StreamEvent::ContentBlockDelta { index, delta });
                    out.push(StreamEvent::ContentBlockStop { index });
                }
            }
        }
        if let Some(end) = end {
            self.close_text(&mut out);
            let called = self.answer.as_ref().is_some_and(StreamedAnswer::called);
            out.push(StreamEvent::MessageDelta {
                delta: MessageDeltaBody {
                    stop_reason: stop_reason(end, called),
                    stop_sequence: end.stop_sequence.clone(),
                },
                usage: OutputUsage {
                    output_tokens: end.generated_tokens,
                },
            });
            out.push(StreamEvent::MessageStop);
        }
        out
    }

    /// A piece of reasoning, in the thinking block (opened first if need be).
    fn think(&mut self, thinking: String, out: &mut Vec<StreamEvent>) {
        if thinking.is_empty() {
            return;
        }
        let index = match self.open_thinking {
            Some(index) => index,
            None => self.open(OutputBlock::thinking(String::new()), out),
        };
        self.open_thinking = Some(index);
        let delta = BlockDelta::ThinkingDelta { thinking };
        out.push(StreamEvent::ContentBlockDelta { index, delta });
    }

    /// Starts the next block; its index.
    fn open(&mut self, block: OutputBlock, out: &mut Vec<StreamEvent>) -> usize {
        let index = self.blocks;
        self.blocks += 1;
        out.push(StreamEvent::ContentBlockStart {
            index,
            content_block: block,
        });
        index
    }

    fn close_text(&mut self, out: &mut Vec<StreamEvent>) {
        if let Some(index) = self.open_text.take() {
            out.push(StreamEvent::ContentBlockStop { index });
        }
    }
}

/// Streams the one sample of `submitted`, opening with `message`.
pub(super) fn respond(
    submitted: Submitted,
    message: Message,
    mut events: Events,
    names: ParamNames,
) -> Response {
    let start = StreamEvent::MessageStart { message };
    let samples = submitted
        .samples
        .into_iter()
        .map(UnboundedReceiverStream::new);
    let body = stream::iter(samples).flatten().flat_map(move |event| {
        let sent = match event {
            Ok(event) => events.token(&event.token.text, event.end.as_ref()),
            Err(e) => vec![StreamEvent::error(ApiError::from_infer(e, &names).into())],
        };
        stream::iter(sent.iter().map(StreamEvent::sse).collect::<Vec<_>>())
    });
    let all = stream::once(async move { start.sse() }).chain(body);
    let mut headers = HeaderMap::new();
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    (headers, Sse::new(all)).into_response()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::{json, Value};

    use super::*;
    use crate::api::tools::{Function, ToolChoice, Tools};
    use crate::infer::FinishReason;

    fn end(text: &str, finish_reason: FinishReason, stop: Option<&str>) -> End {
        End {
            finish_reason,
            stop_sequence: stop.map(str::to_string),
            generated_text: text.into(),
            generated_tokens: 7,
            input_length: 3,
            seed: None,
            cumulative_logprob: 0.0,
            beam_score: None,
            queue_time: Duration::ZERO,
            inference_time: Duration::ZERO,
        }
    }

    fn reading() -> Reading {
        let schema = json!({"type": "object"});
        let f =
            |name: &str| Function::new("tools[0]", name.into(), None, ("s", Some(schema.clone())));
        let tools = Tools {
            functions: vec![f("f").unwrap(), f("g").unwrap()],
            choice: ToolChoice::Auto,
            parallel: true,
        };
        Reading::of(Some(&tools)).unwrap()
    }

    /// `text` streamed a character a token, then put back together as the SDK does.
    fn streamed(text: &str, end: &End, reading: Option<&Reading>) -> (Vec<&'static str>, Value) {
        streamed_thinking(text, end, reading, None)
    }

    /// As `streamed`, the reasoning split from the answer by `thinking`.
    fn streamed_thinking(
        text: &str,
        end: &End,
        reading: Option<&Reading>,
        thinking: Option<&Thinking>,
    ) -> (Vec<&'static str>, Value) {
        let mut events = Events::new(reading, thinking);
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let mut all = vec![StreamEvent::MessageStart {
            message: Message::opening("m".into(), 3),
        }];
        for (i, c) in chars.iter().enumerate() {
            all.extend(events.token(c, (i + 1 == chars.len()).then_some(end)));
        }
        let names = all.iter().map(StreamEvent::name).collect();
        let mut message = Value::Null;
        let mut json_text: Vec<String> = Vec::new();
        for event in &all {
            let v = serde_json::to_value(event).unwrap();
            assert_eq!(v["type"], event.name());
            match event {
                StreamEvent::MessageStart { .. } => message = v["message"].clone(),
                StreamEvent::ContentBlockStart { index, .. } => {
                    let blocks = message["content"].as_array_mut().unwrap();
                    assert_eq!(*index, blocks.len());
                    blocks.push(v["content_block"].clone());
                    json_text.push(String::new());
                }
                StreamEvent::ContentBlockDelta { index, delta } => match delta {
                    BlockDelta::ThinkingDelta { thinking } => {
                        let block = &mut message["content"][*index]["thinking"];
                        *block = format!("{}{thinking}", block.as_str().unwrap()).into();
                    }
                    BlockDelta::TextDelta { text } => {
                        let block = &mut message["content"][*index]["text"];
                        *block = format!("{}{text}", block.as_str().unwrap()).into();
                    }
                    BlockDelta::InputJsonDelta { partial_json } => {
                        json_text[*index].push_str(partial_json)
                    }
                },
                StreamEvent::ContentBlockStop { index } => {
                    if !json_text[*index].is_empty() {
                        message["content"][*index]["input"] =
                            serde_json::from_str(&json_text[*index]).unwrap();
                    }
                }
                StreamEvent::MessageDelta { .. } => {
                    message["stop_reason"] = v["delta"]["stop_reason"].clone();
                    message["stop_sequence"] = v["delta"]["stop_sequence"].clone();
                    message["usage"]["output_tokens"] = v["usage"]["output_tokens"].clone();
                }
                StreamEvent::MessageStop | StreamEvent::Error { .. } => {}
            }
        }
        (names, message)
    }

    /// The answer as the non-streamed route gives it, ids aside.
    fn whole(end: End, reading: Option<&Reading>) -> Value {
        whole_thinking(end, reading, None)
    }

    fn whole_thinking(end: End, reading: Option<&Reading>, thinking: Option<&Thinking>) -> Value {
        let message = Message::opening("m".into(), 3).answered(end, reading, thinking);
        without_ids(serde_json::to_value(message).unwrap())
    }

    fn without_ids(mut message: Value) -> Value {
        message["id"] = Value::Null;
        for block in message["content"].as_array_mut().unwrap() {
            if block["type"] == "tool_use" {
                assert!(block["id"].as_str().unwrap().starts_with("toolu_"));
                block["id"] = Value::Null;
            }
        }
        message
    }

    #[test]
    fn text_then_calls_stream_as_blocks_that_add_up_to_the_message() {
        let text = "Checking.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1]}}\n</tool_call>\n<tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>";
        let reading = reading();
        let e = end(text, FinishReason::EosToken, None);
        let (names, message) = streamed(text, &e, Some(&reading));
        let deltas = names
            .iter()
            .filter(|n| **n == "content_block_delta")
            .count();
        let mut want = vec!["message_start", "content_block_start"];
        want.extend(std::iter::repeat_n("content_block_delta", deltas - 2));
        want.push("content_block_stop");
        for _ in 0..2 {
            want.extend([
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
            ]);
        }
        want.extend(["message_delta", "message_stop"]);
        assert_eq!(names, want);
        let whole = whole(e, Some(&reading));
        assert_eq!(without_ids(message), whole);
        assert_eq!(whole["stop_reason"], "tool_use");
        assert_eq!(
            whole["content"][0],
            json!({"type": "text", "text": "Checking."})
        );
        assert_eq!(
            whole["content"][1],
            json!({"type": "tool_use", "id": null, "name": "f", "input": {"a": [1]}})
        );
        assert_eq!(whole["content"][2]["input"], json!({}));
        assert_eq!(
            whole["usage"],
            json!({"input_tokens": 3, "output_tokens": 7})
        );
    }

    #[test]
    fn stop_reasons_follow_how_generation_ended() {
        let cases = [
            (FinishReason::EosToken, None, "end_turn"),
            (FinishReason::Length, None, "max_tokens"),
            (FinishReason::StopSequence, Some("###"), "stop_sequence"),
        ];
        for (reason, stop, want) in cases {
            let e = end("Hello there", reason, stop);
            let (names, message) = streamed("Hello there", &e, None);
            assert_eq!(names.len(), 1 + 1 + 11 + 1 + 2, "{names:?}");
            assert_eq!(without_ids(message), whole(e.clone(), None));
            let w = whole(e, None);
            assert_eq!(w["stop_reason"], want);
            assert_eq!(w["stop_sequence"], json!(stop));
            assert_eq!(
                w["content"],
                json!([{"type": "text", "text": "Hello there"}])
            );
        }
        // A call cut by the token limit is text, and the reason is the limit's.
        let reading = reading();
        let cut = "<tool_call>{\"name\": \"f\", \"argu";
        let e = end(cut, FinishReason::Length, None);
        let (_, message) = streamed(cut, &e, Some(&reading));
        assert_eq!(without_ids(message), whole(e.clone(), Some(&reading)));
        assert_eq!(whole(e, Some(&reading))["stop_reason"], "max_tokens");
    }

    #[test]
    fn reasoning_is_a_thinking_block_before_the_text_and_calls_streamed_or_whole() {
        use crate::reasoning::ReasoningParser;
        let thinking = Thinking::of(Some(ReasoningParser::Qwen3), "assistant:<think>\n").unwrap();
        let reading = reading();
        let text =
            "Need f.</think>\n\nOk.<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>";
        let e = end(text, FinishReason::EosToken, None);
        let (names, message) = streamed_thinking(text, &e, Some(&reading), Some(&thinking));
        let want = whole_thinking(e.clone(), Some(&reading), Some(&thinking));
        assert_eq!(without_ids(message), want);
        assert_eq!(
            want["content"][0],
            json!({"type": "thinking", "thinking": "Need f.", "signature": ""})
        );
        assert_eq!(want["content"][1], json!({"type": "text", "text": "Ok."}));
        assert_eq!(want["content"][2]["type"], "tool_use");
        assert_eq!(want["stop_reason"], "tool_use");
        // The thinking block closes before the text block opens.
        let opened: Vec<_> = names
            .iter()
            .filter(|n| n.starts_with("content_block_st"))
            .collect();
        assert_eq!(
            opened,
            [
                &"content_block_start",
                &"content_block_stop",
                &"content_block_start",
                &"content_block_stop",
                &"content_block_start",
                &"content_block_stop"
            ]
        );
        // Unterminated, it is all thinking; without a parser the tags stay in the text.
        let e = end("still", FinishReason::Length, None);
        let (_, message) = streamed_thinking("still", &e, None, Some(&thinking));
        assert_eq!(
            without_ids(message)["content"],
            json!([{"type": "thinking", "thinking": "still", "signature": ""}])
        );
        let e = end(text, FinishReason::EosToken, None);
        assert_eq!(whole(e, None)["content"][0]["text"], text);
    }

    #[test]
    fn an_empty_answer_has_no_blocks_and_errors_are_error_events() {
        let mut events = Events::new(None, None);
        let e = end("", FinishReason::EosToken, None);
        let names: Vec<_> = events
            .token("", Some(&e))
            .iter()
            .map(StreamEvent::name)
            .collect();
        assert_eq!(names, ["message_delta", "message_stop"]);
        assert_eq!(whole(e, None)["content"], json!([]));
        let error = ApiError::from_infer(
            crate::error::InferError::Overloaded("busy".into()),
            &ParamNames::TGI,
        );
        let event = StreamEvent::error(error.into());
        assert_eq!(
            serde_json::to_value(&event).unwrap(),
            json!({"type": "error", "error": {"type": "rate_limit_error", "message": "busy"}})
        );
        let unhealthy = ApiError::from_infer(
            crate::error::InferError::Unhealthy("down".into()),
            &ParamNames::TGI,
        );
        let event = StreamEvent::error(unhealthy.into());
        assert_eq!(
            serde_json::to_value(&event).unwrap()["error"]["type"],
            "overloaded_error"
        );
    }
}
