//! The answer as the Responses API's events, in their order: `response.created`,
//! `response.in_progress`, then per output item `response.output_item.added`, for a
//! message `response.content_part.added`, `response.output_text.delta`s,
//! `response.output_text.done`, `response.content_part.done`, for a call
//! `response.function_call_arguments.delta` and `.done`, then
//! `response.output_item.done`; with `--reasoning-parser` the reasoning item first
//! (`response.reasoning_text.delta`s and `.done`); last `response.completed` (or `response.incomplete`)
//! with the whole response. Each carries its `sequence_number`.
//!
//! `Writer` turns the generated text, in pieces, into those events and the response they
//! add up to; the non-streamed answer is the same writer given the whole text, so both
//! answers agree.

use serde::Serialize;
use serde_json::Value;

use super::object::{
    new_id, IncompleteDetails, OutputItem, OutputText, ReasoningText, ResponseObject, ResponseUsage,
};
use crate::api::error::OpenAiErrorDetail;
use crate::api::tools::{DeltaPart, Reading, StreamedAnswer};
use crate::api::{ChoiceFinish, Role};
use crate::reasoning::{Thinking, ThinkingStream};

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type")]
pub enum EventBody {
    #[serde(rename = "response.created")]
    Created { response: ResponseObject },
    #[serde(rename = "response.in_progress")]
    InProgress { response: ResponseObject },
    #[serde(rename = "response.output_item.added")]
    ItemAdded {
        output_index: usize,
        item: OutputItem,
    },
    #[serde(rename = "response.content_part.added")]
    PartAdded {
        item_id: String,
        output_index: usize,
        content_index: usize,
        part: OutputText,
    },
    #[serde(rename = "response.output_text.delta")]
    TextDelta {
        item_id: String,
        output_index: usize,
        content_index: usize,
        delta: String,
        logprobs: Vec<Value>,
    },
    #[serde(rename = "response.output_text.done")]
    TextDone {
        item_id: String,
        output_index: usize,
        content_index: usize,
        text: String,
        logprobs: Vec<Value>,
    },
    #[serde(rename = "response.content_part.done")]
    PartDone {
        item_id: String,
        output_index: usize,
        content_index: usize,
        part: OutputText,
    },
    #[serde(rename = "response.output_item.done")]
    ItemDone {
        output_index: usize,
        item: OutputItem,
    },
    #[serde(rename = "response.reasoning_text.delta")]
    ReasoningDelta {
        item_id: String,
        output_index: usize,
        content_index: usize,
        delta: String,
    },
    #[serde(rename = "response.reasoning_text.done")]
    ReasoningDone {
        item_id: String,
        output_index: usize,
        content_index: usize,
        text: String,
    },
    #[serde(rename = "response.function_call_arguments.delta")]
    ArgumentsDelta {
        item_id: String,
        output_index: usize,
        delta: String,
    },
    #[serde(rename = "response.function_call_arguments.done")]
    ArgumentsDone {
        item_id: String,
        output_index: usize,
        name: String,
        arguments: String,
    },
    #[serde(rename = "response.completed")]
    Completed { response: ResponseObject },
    #[serde(rename = "response.incomplete")]
    Incomplete { response: ResponseObject },
    /// A failure after the stream began.
    #[serde(rename = "error")]
    Error {
        code: Option<String>,
        message: String,
        param: Option<String>,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Event {
    #[serde(flatten)]
    pub body: EventBody,
    pub sequence_number: usize,
}

/// How the output ended: its usual finish reason (`Stop`, `Length`) and the counts.
pub struct Ending {
    pub finish_reason: ChoiceFinish,
    pub usage: ResponseUsage,
}

/// A call announced, its arguments still to come.
struct OpenCall {
    id: String,
    call_id: String,
    name: String,
}

pub struct Writer {
    response: ResponseObject,
    sequence: usize,
    /// Set when the model may call tools: the text is read for calls.
    reading: Option<StreamedAnswer>,
    /// Set with --reasoning-parser: the reasoning is split from the answer.
    thinking: Option<ThinkingStream>,
    /// The reasoning item being written: its id and its text so far.
    reasoning_text: Option<(String, String)>,
    /// The message being written: its id and its text so far.
    text: Option<(String, String)>,
    call: Option<OpenCall>,
    events: Vec<Event>,
}

impl Writer {
    /// A writer of `response` (its output empty, in progress).
    pub fn new(response: ResponseObject, reading: Option<&Reading>) -> Self {
        Self {
            response,
            sequence: 0,
            reading: reading.map(Reading::stream),
            thinking: None,
            reasoning_text: None,
            text: None,
            call: None,
            events: Vec::new(),
        }
    }

    /// The writer with each output's reasoning split from its answer.
    pub fn thinking(mut self, thinking: Option<&Thinking>) -> Self {
        self.thinking = thinking.map(Thinking::stream);
        self
    }

    fn emit(&mut self, body: EventBody) {
        self.events.push(Event {
            body,
            sequence_number: self.sequence,
        });
        self.sequence += 1;
    }

    fn taken(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    /// `response.created` and `response.in_progress`.
    pub fn opening(&mut self) -> Vec<Event> {
        let response = self.response.clone();
        self.emit(EventBody::Created {
            response: response.clone(),
        });
        self.emit(EventBody::InProgress { response });
        self.taken()
    }

    /// The events of the next piece of generated text; with `ending`, the last ones.
    pub fn next(&mut self, text: &str, ending: Option<Ending>) -> Vec<Event> {
        let usual = ending.as_ref().map(|e| e.finish_reason);
        let text = match self.thinking.as_mut() {
            None => text.to_string(),
            Some(thinking) => {
                let parts = thinking.next(text, ending.is_some());
                self.write_reasoning(parts.reasoning);
                parts.content
            }
        };
        if !text.is_empty() || ending.is_some() {
            self.close_reasoning();
        }
        let (parts, reason) = match self.reading.as_mut() {
            None => (vec![DeltaPart::Content(text)], usual),
            Some(answer) => answer.next(&text, usual),
        };
        for part in parts {
            match part {
                DeltaPart::Content(delta) => self.write_text(delta),
                DeltaPart::Call(opening) if opening.id.is_some() => {
                    self.close_text("completed");
                    let call = OpenCall {
                        id: new_id("fc"),
                        call_id: opening.id.unwrap_or_default(),
                        name: opening.function.name.unwrap_or_default(),
                    };
                    let item = call.item(String::new(), "in_progress");
                    let output_index = self.response.output.len();
                    self.emit(EventBody::ItemAdded { output_index, item });
                    self.call = Some(call);
                }
                // A call's second delta carries all its arguments (`ToolCall::deltas`).
                DeltaPart::Call(rest) => self.close_call(rest.function.arguments),
            }
        }
        if let Some(ending) = ending {
            self.end(reason.unwrap_or(ending.finish_reason), ending.usage);
        }
        self.taken()
    }

    fn write_reasoning(&mut self, delta: String) {
        if delta.is_empty() {
            return;
        }
        let output_index = self.response.output.len();
        let item_id = match &self.reasoning_text {
            Some((id, _)) => id.clone(),
            None => {
                let id = new_id("rs");
                let item = reasoning(id.clone(), "in_progress", Vec::new());
                self.emit(EventBody::ItemAdded { output_index, item });
                self.reasoning_text = Some((id.clone(), String::new()));
                id
            }
        };
        if let Some((_, text)) = self.reasoning_text.as_mut() {
            text.push_str(&delta);
        }
        self.emit(EventBody::ReasoningDelta {
            item_id,
            output_index,
            content_index: 0,
            delta,
        });
    }

    fn close_reasoning(&mut self) {
        let Some((item_id, text)) = self.reasoning_text.take() else {
            return;
        };
        let output_index = self.response.output.len();
        self.emit(EventBody::ReasoningDone {
            item_id: item_id.clone(),
            output_index,
            content_index: 0,
            text: text.clone(),
        });
        self.done(reasoning(
            item_id,
            "completed",
            vec![ReasoningText::new(text)],
        ));
    }

    fn write_text(&mut self, delta: String) {
        if delta.is_empty() {
            return;
        }
        let item_id = self.open_text();
        let output_index = self.response.output.len();
        if let Some((_, text)) = self.text.as_mut() {
            text.push_str(&delta);
        }
        self.emit(EventBody::TextDelta {
            item_id,
            output_index,
            content_index: 0,
            delta,
            logprobs: Vec::new(),
        });
    }

    /// The message being written, opened if none is: its id.
    fn open_text(&mut self) -> String {
        if let Some((id, _)) = &self.text {
            return id.clone();
        }
        let id = new_id("msg");
        let output_index = self.response.output.len();
        let item = message(id.clone(), "in_progress", Vec::new());
        self.emit(EventBody::ItemAdded { output_index, item });
        self.emit(EventBody::PartAdded {
            item_id: id.clone(),
            output_index,
            content_index: 0,
            part: OutputText::new(String::new()),
        });
        self.text = Some((id.clone(), String::new()));
        id
    }

    fn close_text(&mut self, status: &'static str) {
        let Some((item_id, text)) = self.text.take() else {
            return;
        };
        let output_index = self.response.output.len();
        self.emit(EventBody::TextDone {
            item_id: item_id.clone(),
            output_index,
            content_index: 0,
            text: text.clone(),
            logprobs: Vec::new(),
        });
        let part = OutputText::new(text);
        self.emit(EventBody::PartDone {
            item_id: item_id.clone(),
            output_index,
            content_index: 0,
            part: part.clone(),
        });
        self.done(message(item_id, status, vec![part]));
    }

    fn close_call(&mut self, arguments: String) {
        let Some(call) = self.call.take() else {
            return;
        };
        let output_index = self.response.output.len();
        self.emit(EventBody::ArgumentsDelta {
            item_id: call.id.clone(),
            output_index,
            delta: arguments.clone(),
        });
        self.emit(EventBody::ArgumentsDone {
            item_id: call.id.clone(),
            output_index,
            name: call.name.clone(),
            arguments: arguments.clone(),
        });
        self.done(call.item(arguments, "completed"));
    }

    fn done(&mut self, item: OutputItem) {
        let output_index = self.response.output.len();
        self.response.output.push(item.clone());
        self.emit(EventBody::ItemDone { output_index, item });
    }

    /// Closes what is open (an answer with no output is one empty message, as the
    /// non-streamed text is) and sends the whole response.
    fn end(&mut self, finish_reason: ChoiceFinish, usage: ResponseUsage) {
        // `Length` means no call ended the output: the token limit cut it.
        let incomplete = finish_reason == ChoiceFinish::Length;
        let answered = self.response.output.iter();
        if !answered
            .into_iter()
            .any(|i| !matches!(i, OutputItem::Reasoning { .. }))
        {
            self.open_text();
        }
        self.close_text(if incomplete {
            "incomplete"
        } else {
            "completed"
        });
        self.response.usage = Some(usage);
        if incomplete {
            self.response.status = "incomplete";
            self.response.incomplete_details = Some(IncompleteDetails {
                reason: "max_output_tokens",
            });
            let response = self.response.clone();
            self.emit(EventBody::Incomplete { response });
        } else {
            self.response.status = "completed";
            let response = self.response.clone();
            self.emit(EventBody::Completed { response });
        }
    }

    /// The `error` event of a failure mid-stream.
    pub fn error(&mut self, e: OpenAiErrorDetail) -> Vec<Event> {
        self.emit(EventBody::Error {
            code: Some(e.code.map_or(e.kind, |code| code.to_string())),
            message: e.message,
            param: e.param,
        });
        self.taken()
    }

    /// The response, as far as it was written.
    pub fn response(&self) -> &ResponseObject {
        &self.response
    }

    pub fn into_response(self) -> ResponseObject {
        self.response
    }
}

impl OpenCall {
    fn item(&self, arguments: String, status: &'static str) -> OutputItem {
        OutputItem::FunctionCall {
            id: self.id.clone(),
            call_id: self.call_id.clone(),
            name: self.name.clone(),
            arguments,
            status,
        }
    }
}

fn reasoning(id: String, status: &'static str, content: Vec<ReasoningText>) -> OutputItem {
    OutputItem::Reasoning {
        id,
        summary: Vec::new(),
        content,
        status,
    }
}

fn message(id: String, status: &'static str, content: Vec<OutputText>) -> OutputItem {
    OutputItem::Message {
        id,
        status,
        role: Role::Assistant,
        content,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::responses::object::tests::response;
    use crate::openai::responses::request;
    use serde_json::json;

    fn kinds(events: &[Event]) -> Vec<String> {
        events
            .iter()
            .map(|e| {
                serde_json::to_value(e).unwrap()["type"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect()
    }

    fn ending(finish_reason: ChoiceFinish) -> Option<Ending> {
        Some(Ending {
            finish_reason,
            usage: ResponseUsage::new(2, 3),
        })
    }

    /// The writer's events for `pieces`, the last one ending with `finish_reason`.
    fn write(
        reading: Option<&Reading>,
        pieces: &[&str],
        finish_reason: ChoiceFinish,
    ) -> (Vec<Event>, ResponseObject) {
        let mut writer = Writer::new(response("resp_1"), reading);
        let mut events = writer.opening();
        for (i, piece) in pieces.iter().enumerate() {
            let end = if i + 1 == pieces.len() {
                ending(finish_reason)
            } else {
                None
            };
            events.extend(writer.next(piece, end));
        }
        (events, writer.into_response())
    }

    fn texts(r: &ResponseObject) -> Vec<(String, String)> {
        r.output
            .iter()
            .map(|item| match item {
                OutputItem::Message {
                    content, status, ..
                } => (status.to_string(), content[0].text.clone()),
                OutputItem::FunctionCall {
                    name, arguments, ..
                } => (name.clone(), arguments.clone()),
                OutputItem::Reasoning { content, .. } => {
                    ("reasoning".into(), content[0].text.clone())
                }
            })
            .collect()
    }

    #[test]
    fn reasoning_is_an_item_before_the_message_streamed_or_whole() {
        use crate::reasoning::ReasoningParser;
        let thinking = Thinking::of(Some(ReasoningParser::DeepseekR1), "Q:").unwrap();
        let text = "<think>a</b</think>The answer.";
        let whole = {
            let mut writer = Writer::new(response("resp_1"), None).thinking(Some(&thinking));
            writer.next(text, ending(ChoiceFinish::Stop));
            writer.into_response()
        };
        let pieces: Vec<String> = text.chars().map(String::from).collect();
        let mut writer = Writer::new(response("resp_1"), None).thinking(Some(&thinking));
        let mut events = Vec::new();
        for (i, piece) in pieces.iter().enumerate() {
            let end = (i + 1 == pieces.len())
                .then(|| ending(ChoiceFinish::Stop))
                .flatten();
            events.extend(writer.next(piece, end));
        }
        let streamed = writer.into_response();
        let want = [
            ("reasoning".to_string(), "a</b".to_string()),
            ("completed".into(), "The answer.".into()),
        ];
        assert_eq!(texts(&whole), want);
        assert_eq!(texts(&streamed), want);
        let mut kinds = kinds(&events);
        kinds.dedup();
        assert_eq!(
            kinds,
            [
                "response.output_item.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let item = serde_json::to_value(&streamed.output[0]).unwrap();
        assert_eq!(item["type"], "reasoning");
        assert_eq!(
            item["content"],
            json!([{"type": "reasoning_text", "text": "a</b"}])
        );
        assert!(item["id"].as_str().unwrap().starts_with("rs_"));
        // Given back as input, a reasoning item is accepted and left out.
        let input = json!([{"type": "reasoning", "id": "rs_1", "summary": []}, "x"]);
        assert!(
            request::input_items(input).is_err(),
            "a bare string is no item"
        );
        let input = json!([item, {"role": "user", "content": "next"}]);
        assert_eq!(request::input_items(input).unwrap().len(), 1);
    }

    #[test]
    fn text_events_come_in_openai_s_order_and_add_up_to_the_response() {
        let (events, r) = write(None, &["Hel", "", "lo"], ChoiceFinish::Stop);
        assert_eq!(
            kinds(&events),
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let numbers: Vec<usize> = events.iter().map(|e| e.sequence_number).collect();
        assert_eq!(numbers, (0..events.len()).collect::<Vec<_>>());
        assert_eq!(r.status, "completed");
        assert_eq!(texts(&r), [("completed".into(), "Hello".into())]);
        let EventBody::Completed { response } = &events.last().unwrap().body else {
            panic!("{events:?}");
        };
        assert_eq!(response, &r);
        // The whole text at once gives the same response.
        let (_, whole) = write(None, &["Hello"], ChoiceFinish::Stop);
        assert_eq!(texts(&whole), texts(&r));
        assert_eq!(
            serde_json::to_value(&events[4]).unwrap(),
            json!({"type": "response.output_text.delta", "sequence_number": 4,
                "item_id": r.output[0].id(), "output_index": 0, "content_index": 0,
                "delta": "Hel", "logprobs": []})
        );
    }

    #[test]
    fn the_token_limit_makes_it_incomplete_and_no_text_is_one_empty_message() {
        let (events, r) = write(None, &["cut"], ChoiceFinish::Length);
        assert_eq!(kinds(&events).last().unwrap(), "response.incomplete");
        assert_eq!(r.status, "incomplete");
        assert_eq!(
            r.incomplete_details,
            Some(IncompleteDetails {
                reason: "max_output_tokens"
            })
        );
        assert_eq!(texts(&r), [("incomplete".into(), "cut".into())]);
        let (_, r) = write(None, &[""], ChoiceFinish::Stop);
        assert_eq!(texts(&r), [("completed".into(), String::new())]);
        assert_eq!(r.usage, Some(ResponseUsage::new(2, 3)));
    }

    #[test]
    fn calls_are_items_with_their_arguments_streamed_or_whole() {
        let tools = request::tools(
            Some(vec![json!({"type": "function", "name": "f"})]),
            None,
            None,
        )
        .unwrap();
        let reading = Reading::of(tools.as_ref());
        let text = "Calling.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>\n<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>";
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        let (events, streamed) = write(reading.as_ref(), &pieces, ChoiceFinish::Stop);
        let (_, whole) = write(reading.as_ref(), &[text], ChoiceFinish::Stop);
        let want = [
            ("completed".to_string(), "Calling.".to_string()),
            ("f".into(), "{\"a\":1}".into()),
            ("f".into(), "{}".into()),
        ];
        assert_eq!(texts(&streamed), want);
        assert_eq!(texts(&whole), want);
        let kinds = kinds(&events);
        let call: Vec<&str> = kinds
            .iter()
            .map(String::as_str)
            .skip_while(|k| *k != "response.output_item.done")
            .skip(1)
            .take(4)
            .collect();
        assert_eq!(
            call,
            [
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done"
            ]
        );
        assert_eq!(kinds.last().unwrap(), "response.completed");
        assert_eq!(streamed.status, "completed");
    }

    #[test]
    fn an_error_is_an_error_event_in_sequence() {
        let mut writer = Writer::new(response("resp_1"), None);
        let opening = writer.opening();
        let [error] = <[Event; 1]>::try_from(writer.error(OpenAiErrorDetail {
            message: "shard failed".into(),
            kind: "server_error".into(),
            param: None,
            code: None,
        }))
        .unwrap();
        assert_eq!(
            serde_json::to_value(error).unwrap(),
            json!({"type": "error", "sequence_number": opening.len(), "code": "server_error",
                "message": "shard failed", "param": null})
        );
    }
}
