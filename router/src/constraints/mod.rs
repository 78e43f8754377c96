//! Structured outputs: grammars that constrain what a request may generate, compiled by
//! llguidance in the router, where the token list lives.
//!
//! - `spec`: what a request asks for (a schema, a regex, a choice, a Lark grammar).

pub mod spec;

pub use spec::{Constraint, Grammar};
