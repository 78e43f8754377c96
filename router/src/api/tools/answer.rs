//! What the route makes of each choice's output when the model may call tools: the
//! message (content and calls) and the finish reason, whole or as stream deltas, both
//! read by `output::CallReader` so they agree.

use std::collections::HashSet;

use super::calls::{ToolCall, ToolCallDelta};
use super::output::{self, CallReader, Piece};
use super::request::{ToolChoice, Tools};
use crate::api::choice::ChoiceFinish;

/// How a request's outputs are read.
#[derive(Clone)]
pub struct Reading {
    /// The functions a call may name.
    names: HashSet<String>,
    /// `tool_choice` named the function (a call then ends with "stop", as OpenAI's).
    named: bool,
}

/// One choice's answer.
#[derive(Debug)]
pub struct Answer {
    /// `None` when the answer is only calls.
    pub content: Option<String>,
    pub calls: Vec<ToolCall>,
    pub finish_reason: ChoiceFinish,
    /// The answer made calls and ended as calls end (`CallReader::called`).
    pub called: bool,
}

/// A piece of a streamed choice: one chunk's delta.
#[derive(Debug, PartialEq)]
pub enum DeltaPart {
    Content(String),
    Call(ToolCallDelta),
}

impl Reading {
    /// `None` unless the model may call (tools given, `tool_choice` not "none").
    pub fn of(tools: Option<&Tools>) -> Option<Self> {
        let tools = tools.filter(|t| t.may_call())?;
        Some(Self {
            names: tools.callable().map(|f| f.name.clone()).collect(),
            named: matches!(tools.choice, ToolChoice::Function(_)),
        })
    }

    /// A whole output, generated to its end; `usual` is how it would end without tools.
    pub fn answer(&self, text: &str, usual: ChoiceFinish) -> Answer {
        let read = output::read(self.names.clone(), [text]);
        Answer {
            content: read.content,
            calls: read.calls,
            finish_reason: self.finish_reason(read.called, usual),
            called: read.called,
        }
    }

    /// A reader of one streamed choice.
    pub fn stream(&self) -> StreamedAnswer {
        StreamedAnswer {
            reader: CallReader::new(self.names.clone()),
            reading: self.clone(),
            calls: 0,
        }
    }

    /// `ToolCalls` once calls were made (OpenAI's `Stop` for a named function), else
    /// the usual reason: an answer cut inside a call ended by its length or a stop.
    fn finish_reason(&self, called: bool, usual: ChoiceFinish) -> ChoiceFinish {
        match (called, self.named) {
            (false, _) => usual,
            (true, true) => ChoiceFinish::Stop,
            (true, false) => ChoiceFinish::ToolCalls,
        }
    }
}

/// One streamed choice, read as its tokens come.
pub struct StreamedAnswer {
    reader: CallReader,
    reading: Reading,
    /// Calls sent so far (the next one's `index`).
    calls: usize,
}

impl StreamedAnswer {
    /// The deltas of the next token's `text`; with the last token (`end`: its usual
    /// finish reason) what is left, and the finish reason.
    pub fn next(
        &mut self,
        text: &str,
        end: Option<ChoiceFinish>,
    ) -> (Vec<DeltaPart>, Option<ChoiceFinish>) {
        let mut parts = Vec::new();
        for piece in self.pieces(text, end.is_some()) {
            match piece {
                Piece::Content(text) => parts.push(DeltaPart::Content(text)),
                Piece::Call(call) => {
                    parts.extend(call.deltas(self.calls).map(DeltaPart::Call));
                    self.calls += 1;
                }
            }
        }
        let reason = end.map(|usual| self.reading.finish_reason(self.called(), usual));
        (parts, reason)
    }

    /// What the next token's `text` makes known, content and whole calls; with the
    /// last token (`ended`) what is left too. For shapes other than OpenAI's deltas.
    pub fn pieces(&mut self, text: &str, ended: bool) -> Vec<Piece> {
        let mut pieces = self.reader.push(text);
        if ended {
            pieces.extend(self.reader.finish());
        }
        pieces
    }

    /// As `Answer::called`, once the output has ended.
    pub fn called(&self) -> bool {
        self.reader.called()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::tools::request::Function;
    use ChoiceFinish::{Length, Stop, ToolCalls};

    fn tools(choice: ToolChoice) -> Tools {
        let function = |name: &str| Function {
            name: name.into(),
            description: None,
            parameters: serde_json::json!({"type": "object"}),
        };
        Tools {
            functions: vec![function("f"), function("g")],
            choice,
            parallel: true,
        }
    }

    const TWO: &str = "Calling.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>\n<tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>";

    #[test]
    fn none_or_no_tools_read_nothing() {
        assert!(Reading::of(None).is_none());
        assert!(Reading::of(Some(&tools(ToolChoice::None))).is_none());
    }

    #[test]
    fn finish_reasons_follow_openai() {
        let auto = Reading::of(Some(&tools(ToolChoice::Auto))).unwrap();
        assert_eq!(auto.answer(TWO, Stop).finish_reason, ToolCalls);
        assert_eq!(auto.answer(TWO, Length).finish_reason, ToolCalls);
        assert_eq!(auto.answer("text", Length).finish_reason, Length);
        let cut = &TWO[..TWO.len() - 2];
        let a = auto.answer(cut, Length);
        assert_eq!((a.finish_reason, a.calls.len()), (Length, 1));
        let named = Reading::of(Some(&tools(ToolChoice::Function("f".into())))).unwrap();
        let one = "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>";
        let a = named.answer(one, Stop);
        assert_eq!((a.finish_reason, a.calls.len(), a.content), (Stop, 1, None));
        // A named choice calls only that function.
        let other = "<tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>";
        let a = named.answer(other, Length);
        assert_eq!((a.finish_reason, a.calls.len()), (Length, 0));
        assert_eq!(a.content.as_deref(), Some(other));
    }

    /// Streamed token by token (as characters), the deltas add up to the whole answer:
    /// content, each call's id, name and arguments, and the finish reason on the last.
    #[test]
    fn streamed_deltas_add_up_to_the_answer() {
        let reading = Reading::of(Some(&tools(ToolChoice::Auto))).unwrap();
        let whole = reading.answer(TWO, Stop);
        let mut stream = reading.stream();
        let chars: Vec<String> = TWO.chars().map(String::from).collect();
        let mut content = String::new();
        let mut calls: Vec<(usize, String, String, String)> = Vec::new();
        let mut reasons = Vec::new();
        for (i, text) in chars.iter().enumerate() {
            let end = (i + 1 == chars.len()).then_some(Stop);
            let (parts, reason) = stream.next(text, end);
            reasons.push(reason);
            for part in parts {
                match part {
                    DeltaPart::Content(text) => content.push_str(&text),
                    DeltaPart::Call(d) if d.id.is_some() => {
                        assert_eq!(d.index, calls.len());
                        assert_eq!(d.kind, Some("function"));
                        assert_eq!(d.function.arguments, "");
                        let name = d.function.name.unwrap();
                        calls.push((d.index, d.id.unwrap(), name, String::new()));
                    }
                    DeltaPart::Call(d) => {
                        assert!(d.function.name.is_none() && d.kind.is_none());
                        calls[d.index].3.push_str(&d.function.arguments);
                    }
                }
            }
        }
        assert_eq!(Some(content), whole.content);
        let got: Vec<_> = calls.iter().map(|c| (c.2.as_str(), c.3.as_str())).collect();
        let want: Vec<_> = whole
            .calls
            .iter()
            .map(|c| (c.function.name.as_str(), c.function.arguments.as_str()))
            .collect();
        assert_eq!(got, want);
        assert!(calls.iter().all(|c| c.1.starts_with("call_")));
        let (last, before) = reasons.split_last().unwrap();
        assert_eq!(*last, Some(ToolCalls));
        assert!(before.iter().all(Option::is_none));
    }
}
