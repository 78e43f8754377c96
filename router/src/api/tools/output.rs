//! The output read back into `content` and calls, incrementally: `CallReader` takes the
//! text in pieces (as a stream brings it; a piece may end inside a tag) and gives what
//! is known so far. The whole text read in one piece gives the same as in any pieces,
//! so a streamed answer adds up to the non-streamed one.
//!
//! - `content` is the text before the first `<tool_call>`, its leading whitespace
//!   dropped; whitespace before a call (or at the end of an answer with calls) too.
//! - A call is given once its block has closed and parses as `{"name", "arguments"}`
//!   naming a callable function: a call cut by the token limit or a stop string is
//!   never announced. From the first block that does not parse (or text that is not a
//!   call after a call), the rest of the text is content, as written.

use std::collections::HashSet;

use serde_json::Value;

use super::calls::ToolCall;
use super::format::{CALL_CLOSE, CALL_OPEN};

/// What one piece of text added to the answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Content(String),
    Call(ToolCall),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the first call.
    Text,
    /// After the first trigger: calls and the whitespace between them.
    Calls,
    /// A block did not parse: content to the end.
    Raw,
}

pub struct CallReader {
    /// The functions a call may name.
    names: HashSet<String>,
    state: State,
    /// Text not decided yet: a possible partial trigger, or an unfinished block.
    pending: String,
    /// Whitespace held back: content if text follows, dropped if a call does.
    held: String,
    /// Content has begun (its leading whitespace is behind).
    started: bool,
    calls: usize,
}

/// The length of the longest end of `text` that begins `tag` (and could become it).
fn partial_tag(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.ends_with(&tag[..n]))
        .unwrap_or(0)
}

/// What the text at the start of a call looks like so far.
enum Block {
    /// A whole block of this many bytes, holding this JSON value.
    Whole(usize, Value),
    /// It may still become one.
    Unfinished,
    /// It cannot.
    Not,
}

fn block(text: &str) -> Block {
    let Some(body) = text.strip_prefix(CALL_OPEN) else {
        return if CALL_OPEN.starts_with(text) {
            Block::Unfinished
        } else {
            Block::Not
        };
    };
    let json = body.trim_start();
    // The object ends where its JSON does (a `</tool_call>` may sit inside a string).
    let mut values = serde_json::Deserializer::from_str(json).into_iter::<Value>();
    let value = match values.next() {
        None => return Block::Unfinished,
        Some(Err(e)) if e.is_eof() => return Block::Unfinished,
        Some(Err(_)) => return Block::Not,
        Some(Ok(value)) => value,
    };
    let close = json[values.byte_offset()..].trim_start();
    if close.starts_with(CALL_CLOSE) {
        Block::Whole(text.len() - close.len() + CALL_CLOSE.len(), value)
    } else if CALL_CLOSE.starts_with(close) {
        Block::Unfinished
    } else {
        Block::Not
    }
}

impl CallReader {
    pub fn new(names: HashSet<String>) -> Self {
        Self {
            names,
            state: State::Text,
            pending: String::new(),
            held: String::new(),
            started: false,
            calls: 0,
        }
    }

    /// What `text`, the next piece of the output, makes known.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        out
    }

    /// What is left once the output has ended.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        match self.state {
            State::Text => {
                let rest = std::mem::take(&mut self.pending);
                self.text(&rest, &mut out);
                // No call follows: trailing whitespace is content.
                content(std::mem::take(&mut self.held), &mut out);
            }
            State::Calls if !self.pending.is_empty() => self.give_up(&mut out),
            State::Calls => self.held.clear(),
            State::Raw => {}
        }
        out
    }

    /// The answer made calls and ended as calls end (nothing unparsed after them).
    pub fn called(&self) -> bool {
        self.calls > 0 && self.state == State::Calls
    }

    /// One step over `pending`; false when it needs more text.
    fn step(&mut self, out: &mut Vec<Piece>) -> bool {
        match self.state {
            State::Raw => {
                let rest = std::mem::take(&mut self.pending);
                content(rest, out);
                false
            }
            State::Text => {
                let pending = std::mem::take(&mut self.pending);
                if let Some(at) = pending.find(CALL_OPEN) {
                    self.text(&pending[..at], out);
                    self.pending = pending[at..].to_string();
                    self.state = State::Calls;
                    return true;
                }
                let keep = pending.len() - partial_tag(&pending, CALL_OPEN);
                self.text(&pending[..keep], out);
                self.pending = pending[keep..].to_string();
                false
            }
            State::Calls => {
                let call = self.pending.trim_start();
                let space = self.pending.len() - call.len();
                self.held.extend(self.pending.drain(..space));
                if self.pending.is_empty() {
                    return false;
                }
                match block(&self.pending) {
                    Block::Unfinished => return false,
                    Block::Whole(len, value) => match self.call(value) {
                        Some(call) => {
                            self.held.clear();
                            self.pending.drain(..len);
                            self.calls += 1;
                            out.push(Piece::Call(call));
                        }
                        None => self.give_up(out),
                    },
                    Block::Not => self.give_up(out),
                }
                true
            }
        }
    }

    /// `{"name": <callable>, "arguments": <any JSON>}` and nothing else.
    fn call(&self, object: Value) -> Option<ToolCall> {
        let Value::Object(mut fields) = object else {
            return None;
        };
        let name = match fields.remove("name")? {
            Value::String(name) if self.names.contains(&name) => name,
            _ => return None,
        };
        let arguments = fields.remove("arguments")?;
        if !fields.is_empty() {
            return None;
        }
        Some(ToolCall::new(name, arguments.to_string()))
    }

    /// Text before the first call: leading whitespace dropped, trailing held back.
    fn text(&mut self, text: &str, out: &mut Vec<Piece>) {
        let text = if self.started {
            text
        } else {
            text.trim_start()
        };
        let body = text.trim_end();
        if !body.is_empty() {
            self.started = true;
            let held = std::mem::take(&mut self.held);
            content(held + body, out);
        }
        self.held.push_str(&text[body.len()..]);
    }

    /// What is not a call, from here on: content as written.
    fn give_up(&mut self, out: &mut Vec<Piece>) {
        self.state = State::Raw;
        let text = std::mem::take(&mut self.held) + &std::mem::take(&mut self.pending);
        content(text, out);
    }
}

fn content(text: String, out: &mut Vec<Piece>) {
    if !text.is_empty() {
        out.push(Piece::Content(text));
    }
}

/// A whole output, read.
#[derive(Debug, PartialEq)]
pub struct Read {
    /// `None` when there is none and calls were made.
    pub content: Option<String>,
    pub calls: Vec<ToolCall>,
    /// As `CallReader::called`.
    pub called: bool,
}

/// Reads the pieces of one output, in order, then its end.
pub fn read<'a>(names: HashSet<String>, pieces: impl IntoIterator<Item = &'a str>) -> Read {
    let mut reader = CallReader::new(names);
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut take = |pieces: Vec<Piece>| {
        for piece in pieces {
            match piece {
                Piece::Content(text) => content.push_str(&text),
                Piece::Call(call) => calls.push(call),
            }
        }
    };
    for text in pieces {
        take(reader.push(text));
    }
    take(reader.finish());
    Read {
        content: (!content.is_empty() || calls.is_empty()).then_some(content),
        calls,
        called: reader.called(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> HashSet<String> {
        ["get_weather", "count"].map(String::from).into()
    }

    /// Name and arguments of each call (ids are random).
    fn calls(read: &Read) -> Vec<(&str, &str)> {
        read.calls
            .iter()
            .map(|c| (c.function.name.as_str(), c.function.arguments.as_str()))
            .collect()
    }

    const PARIS: &str =
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 1.50}}\n</tool_call>";

    #[test]
    fn text_only_is_content_less_its_leading_whitespace() {
        let r = read(names(), ["\n  It is <tool sunny.\n"]);
        assert_eq!(r.content.as_deref(), Some("It is <tool sunny.\n"));
        assert!(r.calls.is_empty() && !r.called);
        let r = read(names(), [""]);
        assert_eq!(r.content.as_deref(), Some(""));
    }

    #[test]
    fn calls_are_compact_json_and_content_is_the_text_before_them_trimmed() {
        let text = format!(" Let me check.\n{PARIS}\n<tool_call>{{\"name\":\"count\",\"arguments\":{{}}}}</tool_call>\n\n");
        let r = read(names(), [text.as_str()]);
        assert_eq!(r.content.as_deref(), Some("Let me check."));
        assert_eq!(
            calls(&r),
            [
                ("get_weather", "{\"city\":\"Paris\",\"days\":1.5}"),
                ("count", "{}")
            ]
        );
        assert!(r.called);
        let r = read(names(), [PARIS]);
        assert_eq!(r.content, None);
        assert_eq!(calls(&r).len(), 1);
    }

    #[test]
    fn a_call_cut_short_is_content_and_no_call() {
        let cut = &PARIS[..PARIS.len() - 3];
        let text = format!("Checking. {cut}");
        let r = read(names(), [text.as_str()]);
        assert_eq!(r.content.as_deref(), Some(text.as_str()));
        assert!(r.calls.is_empty() && !r.called);
        // After a whole call, the cut one is content, and the answer did not end as calls.
        let text = format!("{PARIS}\n<tool_call>{{\"name\": \"cou");
        let r = read(names(), [text.as_str()]);
        assert_eq!(r.content.as_deref(), Some("\n<tool_call>{\"name\": \"cou"));
        assert_eq!(calls(&r).len(), 1);
        assert!(!r.called);
    }

    #[test]
    fn blocks_that_are_not_calls_are_content() {
        let cases = [
            "<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"count\"}</tool_call>",
            "<tool_call>{\"name\": \"count\", \"arguments\": {}, \"x\": 1}</tool_call>",
            "<tool_call>[1]</tool_call>",
            "<tool_call>{\"name\": \"count\", \"arguments\": {}} trailing</tool_call>",
            "<tool_call>no json</tool_call>",
        ];
        for text in cases {
            let r = read(names(), [text]);
            assert_eq!(r.content.as_deref(), Some(text));
            assert!(r.calls.is_empty());
        }
        let after = format!("{PARIS} Done.");
        let r = read(names(), [after.as_str()]);
        assert_eq!(r.content.as_deref(), Some(" Done."));
        assert_eq!(calls(&r).len(), 1);
        assert!(!r.called);
    }

    #[test]
    fn a_close_tag_inside_a_json_string_does_not_end_the_call() {
        let text = "<tool_call>{\"name\": \"count\", \"arguments\": {\"s\": \"a</tool_call>b\"}}</tool_call>";
        let r = read(names(), [text]);
        assert_eq!(calls(&r), [("count", "{\"s\":\"a</tool_call>b\"}")]);
    }

    /// The same output split at every character boundary, and split into single
    /// characters, reads as in one piece.
    #[test]
    fn any_split_reads_as_the_whole() {
        let outputs = [
            format!("Sure — checking the weather.\n\n{PARIS}\n{PARIS} \n"),
            format!("  \n{PARIS}"),
            "<tool_call>{\"name\": \"count\", \"arguments\": {\"a\": [-1.5e3, true, null, \"\\u00e9\\n\"], \"b\": {}}}</tool_call>".into(),
            format!("Hi <tool there <tool_call {PARIS}"),
            format!("{PARIS}\n<tool_call>{{\"name\": \"cou"),
            format!("{PARIS} after"),
            "ends with a partial <tool_ca".into(),
            "trailing space, no calls  \n".into(),
            "<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call> x".into(),
        ];
        for text in &outputs {
            let whole = read(names(), [text.as_str()]);
            let bounds: Vec<usize> = (0..=text.len())
                .filter(|&i| text.is_char_boundary(i))
                .collect();
            let mut splits: Vec<Vec<&str>> = bounds
                .iter()
                .map(|&i| vec![&text[..i], &text[i..]])
                .collect();
            splits.push(bounds.windows(2).map(|w| &text[w[0]..w[1]]).collect());
            for pieces in splits {
                let split = read(names(), pieces.iter().copied());
                assert_eq!(split.content, whole.content, "{pieces:?}");
                assert_eq!(calls(&split), calls(&whole), "{pieces:?}");
                assert_eq!(split.called, whole.called, "{pieces:?}");
            }
        }
    }
}
