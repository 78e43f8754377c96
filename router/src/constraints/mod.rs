//! Structured outputs: grammars that constrain what a request may generate, compiled by
//! llguidance in the router, where the token list lives, so every tensor-parallel rank
//! gets the same mask and a bad grammar is refused at admission.
//!
//! - `spec`: what a request asks for (a schema, a regex, a choice, a Lark grammar).
//! - `tokenizer_env`: the model's vocabulary as llguidance sees it.
//! - `compiler`: grammars compiled off the batching loop, cached, within a time bound.
//! - `state`: one request's position in its grammar: the mask for its next sampled token,
//!   the tokens it took, the tokens the grammar forces (fast-forward).

pub mod compiler;
pub mod spec;
pub mod state;
pub mod tokenizer_env;

pub use compiler::{CompileError, Compiled, Compiler};
pub use spec::{Constraint, Grammar};
pub use state::{GrammarState, MaskShape};
pub use tokenizer_env::tok_env;

#[cfg(test)]
mod tests;
