//! Reasoning output (`--reasoning-parser`): a thinking model's `<think>…</think>` section
//! split from its answer, whole or as the tokens stream in, so each API can give it its
//! own field (chat's `reasoning`, Anthropic's `thinking` blocks, Responses' `reasoning`
//! items). A tag may arrive split over several tokens: the stream holds back what could
//! still be the start of one.
//!
//! Where the output starts is read from the rendered prompt, which the router has: a
//! template that opened `<think>` (Qwen3-Thinking, DeepSeek-R1's own) starts the output
//! inside the reasoning, one that wrote the empty `<think></think>` block (Qwen3 with
//! `enable_thinking: false`) starts it in the answer. Otherwise the parser decides:
//! `deepseek_r1` takes the output to start inside the reasoning (R1 often omits the
//! opening tag), `qwen3` only when the output opens with `<think>`. An output that never
//! closes its reasoning is all reasoning.

#[cfg(test)]
mod tests;

use clap::ValueEnum;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// `--reasoning-parser`: how a model's output marks its reasoning (vLLM's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReasoningParser {
    /// DeepSeek-R1 and its distills, QwQ: the output is reasoning until `</think>`.
    #[value(name = "deepseek_r1", alias = "deepseek-r1")]
    DeepseekR1,
    /// Qwen3: reasoning only inside `<think>…</think>` (or after a prompt that opened it).
    #[value(name = "qwen3")]
    Qwen3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Section {
    Reasoning,
    Content,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The output may open with `<think>` (dropped, reasoning follows); if it does not,
    /// it starts in `otherwise`.
    Opening {
        otherwise: Section,
    },
    In(Section),
}

/// How one request's outputs are split: where they start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thinking {
    start: Mode,
}

/// A whole output split: the reasoning (`None` when there was none) and the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    pub reasoning: Option<String>,
    pub content: String,
}

/// What a piece of streamed output adds: reasoning text, then answer text (a piece
/// never goes back from the answer to the reasoning).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Parts {
    pub reasoning: String,
    pub content: String,
}

impl Thinking {
    /// How outputs of `prompt` split under `parser`; `None` without a parser.
    pub fn of(parser: Option<ReasoningParser>, prompt: &str) -> Option<Self> {
        let parser = parser?;
        let tail = prompt.trim_end();
        let start = if tail.ends_with(OPEN) {
            Mode::Opening {
                otherwise: Section::Reasoning,
            }
        } else if tail.ends_with(CLOSE) {
            Mode::In(Section::Content)
        } else {
            let otherwise = match parser {
                ReasoningParser::DeepseekR1 => Section::Reasoning,
                ReasoningParser::Qwen3 => Section::Content,
            };
            Mode::Opening { otherwise }
        };
        Some(Self { start })
    }

    /// A whole output split (what the stream gives, added up).
    pub fn split(&self, text: &str) -> Split {
        let parts = self.stream().next(text, true);
        Split {
            reasoning: (!parts.reasoning.is_empty()).then_some(parts.reasoning),
            content: parts.content,
        }
    }

    /// A splitter of one streamed output.
    pub fn stream(&self) -> ThinkingStream {
        ThinkingStream {
            mode: self.start,
            pending: String::new(),
        }
    }
}

/// One output split as its text comes.
#[derive(Debug, Clone)]
pub struct ThinkingStream {
    mode: Mode,
    /// Text that may still be (the start of) a tag.
    pending: String,
}

impl ThinkingStream {
    /// What the next `text` makes known; with the last (`ended`) what was held back too.
    pub fn next(&mut self, text: &str, ended: bool) -> Parts {
        let mut parts = Parts::default();
        self.pending.push_str(text);
        loop {
            match self.mode {
                Mode::Opening { otherwise } => {
                    if let Some(rest) = self.pending.strip_prefix(OPEN) {
                        self.pending = rest.to_string();
                        self.mode = Mode::In(Section::Reasoning);
                    } else if OPEN.starts_with(self.pending.as_str()) && !ended {
                        break;
                    } else {
                        self.mode = Mode::In(otherwise);
                    }
                }
                Mode::In(Section::Content) => {
                    parts.content.push_str(&std::mem::take(&mut self.pending));
                    break;
                }
                Mode::In(Section::Reasoning) => {
                    if let Some(at) = self.pending.find(CLOSE) {
                        parts.reasoning.push_str(&self.pending[..at]);
                        self.pending.drain(..at + CLOSE.len());
                        self.mode = Mode::In(Section::Content);
                        continue;
                    }
                    let held = if ended {
                        0
                    } else {
                        partial_close(&self.pending)
                    };
                    let sent = self.pending.len() - held;
                    parts.reasoning.push_str(&self.pending[..sent]);
                    self.pending.drain(..sent);
                    break;
                }
            }
        }
        parts
    }
}

/// The length of the longest end of `text` that begins `</think>` without being all of
/// it: what may be completed by the next token.
fn partial_close(text: &str) -> usize {
    (1..CLOSE.len())
        .rev()
        .find(|&k| text.ends_with(&CLOSE[..k]))
        .unwrap_or(0)
}
