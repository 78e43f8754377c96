//! Compiling a request's `Constraint` into a grammar matcher: once per distinct grammar
//! (a small cache keyed by the grammar), on the blocking pool so the batching loop never
//! waits for it, and within a time bound so a pathological schema fails its own request
//! with a clear error instead of stalling others.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use toktrie::{InferenceCapabilities, TokEnv};

use super::spec::{Constraint, Grammar};

/// Distinct grammars kept compiled.
const CACHE_ENTRIES: usize = 128;

/// A grammar compiled for the model's vocabulary, before any token: each request
/// constrained by it starts from a clone.
#[derive(Clone)]
pub struct Compiled {
    matcher: Matcher,
    /// The request field that asked for it.
    pub field: Arc<str>,
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compiled")
            .field("field", &self.field)
            .finish_non_exhaustive()
    }
}

impl Compiled {
    pub fn start(&self) -> Matcher {
        self.matcher.clone()
    }
}

/// Why a constraint cannot be used; the message names the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileError(pub String);

/// What compiling took: `None` for a cache hit.
pub type CompileTime = Option<Duration>;

pub struct Compiler {
    factory: Arc<ParserFactory>,
    bound: Duration,
    cache: Mutex<Cache>,
}

#[derive(Default)]
struct Cache {
    entries: HashMap<String, Compiled>,
    /// Keys, least recently used first.
    order: VecDeque<String>,
}

impl Cache {
    fn get(&mut self, key: &str) -> Option<Compiled> {
        let hit = self.entries.get(key)?.clone();
        self.order.retain(|k| k != key);
        self.order.push_back(key.to_string());
        Some(hit)
    }

    fn put(&mut self, key: String, compiled: Compiled) {
        if self.entries.len() >= CACHE_ENTRIES {
            if let Some(oldest) = self.order.pop_front() {
                self.entries.remove(&oldest);
            }
        }
        self.order.push_back(key.clone());
        self.entries.insert(key, compiled);
    }
}

/// JSON as a model should write it: one space after `,` and `:`, no other whitespace
/// between tokens (flexible whitespace lets small models pad forever), unless the schema
/// sets llguidance's own `x-guidance` options.
fn with_json_layout(mut schema: Value) -> Value {
    if let Value::Object(map) = &mut schema {
        map.entry("x-guidance").or_insert_with(
            || json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// A regular expression as a Lark string literal matching it exactly.
fn lark_literal(text: &str) -> String {
    serde_json::to_string(text).expect("strings serialize")
}

fn top_level(grammar: &Grammar) -> TopLevelGrammar {
    match grammar {
        Grammar::JsonSchema(schema) => {
            TopLevelGrammar::from_json_schema(with_json_layout(schema.clone()))
        }
        Grammar::Regex(regex) => TopLevelGrammar::from_regex(regex),
        Grammar::Choice(options) => {
            let alternatives: Vec<String> = options.iter().map(|o| lark_literal(o)).collect();
            TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
        }
        Grammar::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
    }
}

/// The cache key: the grammar's kind and text (serde_json writes objects with sorted keys,
/// so equal schemas give equal keys).
fn key(grammar: &Grammar) -> String {
    match grammar {
        Grammar::JsonSchema(schema) => format!("json\0{schema}"),
        Grammar::Regex(regex) => format!("regex\0{regex}"),
        Grammar::Choice(options) => format!("choice\0{}", json!(options)),
        Grammar::Lark(text) => format!("lark\0{text}"),
    }
}

impl Compiler {
    /// `bound`: the longest one compilation may take before its request fails.
    pub fn new(env: &TokEnv, bound: Duration) -> Result<Self, String> {
        let caps = InferenceCapabilities {
            ff_tokens: true,
            ..Default::default()
        };
        let slices = llguidance::earley::SlicedBiasComputer::general_slices();
        let mut factory = ParserFactory::new(env, caps, &slices).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Self {
            factory: Arc::new(factory),
            bound,
            cache: Mutex::new(Cache::default()),
        })
    }

    /// Compiles (or finds) `constraint`'s grammar and computes its first mask, so that the
    /// lexer states the start needs are built here rather than in the batching loop.
    pub async fn compile(
        &self,
        constraint: &Constraint,
    ) -> Result<(Compiled, CompileTime), CompileError> {
        let key = key(&constraint.grammar);
        if let Some(hit) = self.cache.lock().expect("cache lock").get(&key) {
            return Ok((hit, None));
        }
        let factory = self.factory.clone();
        let grammar = top_level(&constraint.grammar);
        let field: Arc<str> = constraint.field.as_str().into();
        let started = Instant::now();
        let work = tokio::task::spawn_blocking(move || compile_now(&factory, grammar));
        let compiled = match tokio::time::timeout(self.bound, work).await {
            Err(_) => {
                return Err(CompileError(format!(
                    "{field}: compiling the grammar took longer than {} ms; simplify it",
                    self.bound.as_millis()
                )))
            }
            Ok(Err(e)) => return Err(CompileError(format!("{field}: compilation failed: {e}"))),
            Ok(Ok(Err(e))) => return Err(CompileError(format!("{field}: {e}"))),
            Ok(Ok(Ok(matcher))) => Compiled { matcher, field },
        };
        let took = started.elapsed();
        self.cache
            .lock()
            .expect("cache lock")
            .put(key, compiled.clone());
        Ok((compiled, Some(took)))
    }
}

fn compile_now(factory: &ParserFactory, grammar: TopLevelGrammar) -> Result<Matcher, String> {
    let parser = factory.create_parser(grammar).map_err(|e| e.to_string())?;
    let mut matcher = Matcher::new(Ok(parser));
    if let Some(e) = matcher.get_error() {
        return Err(e);
    }
    let mask = matcher.compute_mask().map_err(|e| e.to_string())?;
    if mask.is_zero() && !matcher.is_accepting().unwrap_or(false) {
        return Err("the grammar matches no text".into());
    }
    Ok(matcher)
}
