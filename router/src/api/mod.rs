//! What every wire format (TGI's routes, OpenAI's chat/completions and Responses,
//! Anthropic's Messages) has in common; each API's module only converts its shapes to
//! and from these.
//!
//! - `state`: `AppState`, what every handler is given.
//! - `sampling`: the sampling fields, declared once, and the parameters they become.
//! - `submit`: a prepared request (`Generation`) submitted to the batching loop, its
//!   samples read to the end, the usage and timing headers.
//! - `conversation`: a conversation rendered by the chat template, constrained to the
//!   tools' grammar or the requested format.
//! - `tools`: tool definitions, the tool prompt and grammar, calls read back.
//! - `adapters`: the LoRA adapter a request's `model` names.
//! - `choice`: how a choice ended and who speaks it.
//! - `names`, `error`: errors naming each API's own fields.
//! - `body`, `headers`: the request body within its limit, the operators' headers.
//! - `store`: finished responses kept for follow-ups.

pub(crate) mod adapters;
mod beam;
pub(crate) mod body;
pub(crate) mod choice;
pub(crate) mod conversation;
pub(crate) mod error;
pub(crate) mod headers;
pub(crate) mod names;
pub(crate) mod sampling;
pub(crate) mod state;
pub(crate) mod store;
pub(crate) mod submit;
pub(crate) mod tools;

pub(crate) use adapters::model_adapter;
pub use body::read_body;
pub use choice::{ChoiceFinish, Role};
pub(crate) use conversation::{template_prompt, Conversation, Prepared};
pub(crate) use error::parse_json;
pub use error::{ApiError, OpenAiError, OpenAiErrorDetail, OpenAiJson};
pub use headers::{stream_headers, timing_headers};
pub(crate) use names::ParamNames;
pub use sampling::StopInput;
pub(crate) use sampling::{with_sampling_fields, Sampling, SamplingFields};
pub use state::{AppState, Info, LoraInfo};
pub use store::ResponseStore;
pub use submit::Usage;
pub(crate) use submit::{collect_all, Generation};
