//! cadence's router: HTTP API, validation, tokenization, queue, continuous-batching
//! scheduler, KV block accounting, incremental detokenization, stop strings, streaming,
//! in front of the Python model shards (gRPC over unix sockets).
//!
//! At start: `client` connects to every shard, checks its `Info`, and `warmup` sizes the
//! KV cache. The per-token path: `server` (HTTP) → `validation` → `infer` (the batching
//! loop) → `scheduler` (+ `queue`, `blocks`) → `client` (each step on every shard's step
//! stream) → `infer` again (`detokenize`, `stop`) → the client's stream.
//!
//! For orchestrators: `/health` is liveness, `/ready` readiness (`readiness`), and
//! SIGTERM drains before the router exits (`drain`).

pub mod access;
pub mod anthropic;
pub mod api;
pub mod args;
pub mod blocks;
pub mod chat;
pub mod client;
pub mod constraints;
pub mod detokenize;
pub mod docs;
pub mod drain;
pub mod error;
pub mod infer;
pub mod logging;
pub mod lora;
pub mod metrics;
pub mod openai;
pub mod openapi;
pub mod playground;
#[cfg(feature = "python")]
mod python;
pub mod readiness;
pub mod reasoning;
pub mod rejections;
pub mod request_id;
pub mod request_scope;
pub mod scheduler;
pub mod server;
pub mod speculative;
pub mod status;
pub mod stop;
pub mod telemetry;
pub mod tenants;
#[cfg(test)]
mod tests;
pub mod tgi;
pub mod tls;
pub mod unrouted;
pub mod usage;
pub mod validation;
pub mod warmup;

/// Generated from `proto/shard.proto`.
pub mod pb {
    tonic::include_proto!("cadence.shard.v1");
}

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use clap::Parser;
use tokio::net::TcpListener;
use tokio::task::JoinError;

use crate::access::Access;
use crate::api::{AppState, Info};
use crate::args::{Args, SpeculativeArg};
use crate::chat::ChatTemplate;
use crate::client::ShardClient;
use crate::constraints::{Compiler, MaskShape};
use crate::detokenize::TokenizerInfo;
use crate::error::RouterError;
use crate::infer::{Infer, LoopConfig, SpeculativeConfig, SpeculativeMethod};
use crate::readiness::{HealthProbe, Readiness};
use crate::scheduler::objectives::ObjectivePriorities;
use crate::telemetry::Telemetry;
use crate::tenants::reload::KeyFile;
use crate::tenants::{KeyRing, Tenants};
use crate::validation::{Constraints, Validation};

/// After a drain, how long connections get to write what they still hold (the last
/// events of a stream, or the error events of a cut) when the shutdown timeout is near.
const FLUSH_GRACE: Duration = Duration::from_secs(2);

/// Parses `argv` (program name first), runs the router until SIGINT/SIGTERM on a new
/// multi-threaded runtime. `--help` and `--version` print and return Ok.
pub fn run(argv: Vec<String>) -> Result<(), RouterError> {
    let args = match Args::try_parse_from(argv) {
        Ok(args) => args,
        Err(e) if !e.use_stderr() => {
            print!("{e}");
            return Ok(());
        }
        Err(e) => return Err(RouterError::Args(e.render().to_string())),
    };
    logging::init(args.log_format);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("cadence-router")
        .build()?;
    runtime.block_on(async {
        let telemetry = Telemetry::start(args.otlp_endpoint.as_deref(), &args.otlp_service_name)
            .map_err(RouterError::Args)?;
        let served = serve(args).await;
        telemetry.shutdown().await; // the spans still buffered, exported
        served
    })
}

/// Connects to the shards, checks them against the flags, warms them up, serves HTTP until
/// a signal, then drains.
pub async fn serve(args: Args) -> Result<(), RouterError> {
    let tokenizer =
        TokenizerInfo::from_dir(&args.tokenizer).map_err(|message| RouterError::Tokenizer {
            path: args.tokenizer.display().to_string(),
            message,
        })?;
    let chat =
        ChatTemplate::load(&args.tokenizer, args.chat_template.as_deref()).map_err(|message| {
            RouterError::Tokenizer {
                path: args.tokenizer.display().to_string(),
                message,
            }
        })?;
    let api_keys = args.api_keys().map_err(RouterError::Args)?;
    let objectives =
        ObjectivePriorities::parse(&args.objective_priorities).map_err(RouterError::Args)?;
    // Read before the shards are reached, so a bad certificate fails the start at once.
    let tls = tls_files(&args)
        .map(|f| tls::server_config(&f))
        .transpose()?;
    let docs = docs::Docs::from_flag(args.docs_assets.as_deref()).map_err(RouterError::Args)?;
    let groups = args.shard_groups().map_err(RouterError::Args)?;
    let mut replicas = Vec::with_capacity(groups.len());
    for paths in &groups {
        let shards = ShardClient::connect(paths, Duration::from_secs(args.shard_connect_timeout))
            .await?
            .with_agreement_check(args.check_rank_agreement);
        let infos = shards.info().await?;
        check_group(&shards, &infos)?;
        replicas.push((
            shards,
            infos.into_iter().next().expect("one shard at least"),
        ));
    }
    let info = &replicas[0].1;
    for (i, (_, other)) in replicas.iter().enumerate().skip(1) {
        if (&other.model_id, other.block_size, other.vocab_size)
            != (&info.model_id, info.block_size, info.vocab_size)
        {
            return Err(RouterError::Mismatch(format!(
                "replica {i} serves {} (block_size {}) but replica 0 serves {} (block_size {})",
                other.model_id, other.block_size, info.model_id, info.block_size
            )));
        }
    }
    let world_size = replicas[0].0.world_size();
    args.check_warmup().map_err(RouterError::Args)?;
    let groups: Vec<ShardClient> = replicas.iter().map(|(s, _)| s.clone()).collect();
    let caches = warmup::warm_up_replicas(&groups, args.warmup_request()).await?;
    // Requests must fit every replica: the limits come from the smallest cache.
    let cache = *caches
        .iter()
        .min_by_key(|c| c.num_blocks)
        .expect("one replica at least");
    let limits = args
        .limits(info.max_position_embeddings, cache)
        .map_err(RouterError::Args)?;
    tracing::info!(
        model = %info.model_id,
        model_type = %info.model_type,
        dtype = %info.dtype,
        device = %info.device,
        world_size,
        replicas = groups.len(),
        max_input_tokens = limits.max_input_tokens,
        max_total_tokens = limits.max_total_tokens,
        num_blocks = cache.num_blocks,
        async_scheduling = !args.no_async_scheduling,
        kernels = ?info.kernels,
        quantization = ?info.quantization,
        "shards ready"
    );
    args.check_speculative(&info.draft_model)
        .map_err(RouterError::Args)?;
    let speculative = speculative_config(&args, info);
    let adapters = lora::Registry::new(
        args.lora_config(),
        groups
            .iter()
            .map(|g| Arc::new(g.clone()) as Arc<dyn lora::AdapterShards>)
            .collect(),
    );
    adapters
        .load_at_start()
        .await
        .map_err(RouterError::Adapter)?;
    let served_model_names = args.served_model_names();
    let served_model_name = served_model_names[0].clone();
    let app_info = Info {
        model_id: args.model_id.clone(),
        served_model_name: served_model_name.clone(),
        served_model_names,
        model_dtype: info.dtype.clone(),
        model_device_type: info.device.split(':').next().unwrap_or("").to_string(),
        model_pipeline_tag: "text-generation",
        max_input_tokens: limits.max_input_tokens,
        max_total_tokens: limits.max_total_tokens,
        max_batch_tokens: args.max_batch_tokens as usize,
        max_batch_size: args.max_batch_size as usize,
        max_concurrent_requests: args.max_concurrent_requests,
        scheduling_policy: args.scheduling_policy().as_str(),
        max_best_of: args.max_best_of,
        max_stop_sequences: args.max_stop_sequences,
        max_top_n_tokens: args.max_top_n_tokens,
        block_size: cache.block_size,
        num_blocks: cache.num_blocks,
        world_size,
        replicas: groups.len(),
        kernels: info.kernels.clone().into_iter().collect(),
        quantization: info.quantization.clone().into_iter().collect(),
        speculative: speculative_info(speculative.as_ref(), info),
        lora: None,
        version: env!("CARGO_PKG_VERSION"),
        router: "cadence",
    };
    let constraints = structured_outputs(&args, &tokenizer, info);
    let validation = Validation {
        tokenizer,
        limits,
        model_id: args.model_id.clone(),
        constraints,
    };
    let mask_shape = MaskShape {
        logits_width: logits_width(&validation.tokenizer, info),
        eos: info.eos_token_ids.clone().into(),
    };
    let loops = groups
        .iter()
        .zip(&caches)
        .map(|(shards, &cache)| {
            let mut scheduler = args.scheduler_config(cache);
            scheduler.speculative_max_step_tokens =
                speculative.as_ref().map_or(0, |s| s.max_step_tokens);
            let config = LoopConfig {
                scheduler,
                eos_token_ids: info.eos_token_ids.clone(),
                max_waiting_requests: args.max_waiting_requests,
                served_model_name: served_model_name.clone(),
                async_scheduling: !args.no_async_scheduling,
                mask_shape: mask_shape.clone(),
                grammar_fast_forward: !args.no_grammar_fast_forward,
                speculative,
                adapters: adapters.clone(),
            };
            (shards.clone(), config)
        })
        .collect();
    let tenants = Arc::new(Tenants::new(
        &api_keys,
        args.max_concurrent_requests_per_key.map(|n| n as usize),
        args.max_tokens_per_minute_per_key.unwrap_or(0),
    ));
    let key_ring = KeyRing::new(&api_keys);
    if let Some(path) = &args.api_key_file {
        KeyFile {
            path: path.clone(),
            fixed: args.fixed_api_keys(),
            ring: key_ring.clone(),
            tenants: tenants.clone(),
        }
        .watch();
    }
    let infer = Infer::spawn_replicas(loops, validation, args.max_concurrent_requests)
        .with_tenants(tenants)
        .with_objective_priorities(objectives);
    infer.metrics().set_quantization(&app_info.quantization);
    tracing::info!(
        chat_template = chat.is_some(),
        api_keys = api_keys.len(),
        "HTTP surface"
    );
    let probes = groups
        .iter()
        .map(|s| Arc::new(s.clone()) as Arc<dyn HealthProbe>)
        .collect();
    let readiness =
        Readiness::for_replicas(probes, Duration::from_millis(args.ready_stall_timeout_ms));
    readiness.clone().monitor(infer.clone());
    let app = server::router(
        AppState {
            infer: infer.clone(),
            info: app_info,
            shards: groups,
            chat: chat.map(Arc::new),
            reasoning: args.reasoning_parser,
            readiness,
            responses: Default::default(),
        },
        docs::routes(docs).merge(playground::routes()),
    );
    let access = Access {
        api_keys,
        key_ring: Some(key_ring).filter(|ring| !ring.current().is_empty()),
        cors_allow_origin: args.cors_allow_origin.clone(),
        cors_allow_headers: args.cors_allow_headers.clone(),
        cors_allow_methods: args.cors_allow_methods.clone(),
        payload_limit: args.payload_limit,
    };
    let app = access::layers(app, access);
    let app = rejections::layers(app, infer.metrics().clone());
    let shutdown_timeout = Duration::from_secs(args.shutdown_timeout);
    let listener = TcpListener::bind((args.hostname.as_str(), args.port)).await?;
    let address = listener.local_addr()?;
    match tls {
        Some(config) => {
            let listener = tls::TlsListener::new(listener, config)?;
            tracing::info!(%address, "listening (HTTPS)");
            serve_until_drained(listener, app, &infer, shutdown_timeout).await?;
        }
        None => {
            tracing::info!(%address, "listening");
            serve_until_drained(listener, app, &infer, shutdown_timeout).await?;
        }
    }
    tracing::info!("shut down");
    Ok(())
}

/// The TLS files when HTTPS is asked for (clap makes the certificate and key go together).
fn tls_files(args: &Args) -> Option<tls::TlsFiles<'_>> {
    Some(tls::TlsFiles {
        certfile: args.ssl_certfile.as_deref()?,
        keyfile: args.ssl_keyfile.as_deref()?,
    })
}

/// Speculative decoding's settings from the flags and the shards' threshold (None: off).
fn speculative_config(args: &Args, info: &pb::InfoResponse) -> Option<SpeculativeConfig> {
    let method = match args.speculative? {
        SpeculativeArg::Ngram => SpeculativeMethod::Ngram,
        SpeculativeArg::Draft => SpeculativeMethod::Draft,
        SpeculativeArg::Synthetic => SpeculativeMethod::Synthetic,
    };
    let max_step_tokens = match args.speculative_max_step_tokens {
        0 => info.speculative_max_step_tokens as usize,
        n => n,
    };
    Some(SpeculativeConfig {
        method,
        max_tokens: args.num_speculative_tokens,
        ngram_min: args.ngram_min,
        ngram_max: args.ngram_max,
        max_step_tokens,
    })
}

/// `/info`'s `speculative`: empty when off.
fn speculative_info(
    config: Option<&SpeculativeConfig>,
    info: &pb::InfoResponse,
) -> std::collections::BTreeMap<String, String> {
    let Some(c) = config else {
        return Default::default();
    };
    let source = if c.max_step_tokens == info.speculative_max_step_tokens as usize {
        info.speculative_threshold_source.clone()
    } else {
        "--speculative-max-step-tokens".to_string()
    };
    let mut out: std::collections::BTreeMap<String, String> = [
        ("method", c.method.as_str().to_string()),
        ("num_speculative_tokens", c.max_tokens.to_string()),
        ("max_step_tokens", c.max_step_tokens.to_string()),
        ("threshold_source", source),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    match c.method {
        SpeculativeMethod::Ngram => {
            out.insert("ngram".into(), format!("{}..{}", c.ngram_min, c.ngram_max));
        }
        SpeculativeMethod::Draft => {
            out.insert("draft_model".into(), info.draft_model.clone());
        }
        SpeculativeMethod::Synthetic => {}
    }
    out
}

/// Checks one shard group's `Info` answers against each other and its size.
fn check_group(shards: &ShardClient, infos: &[pb::InfoResponse]) -> Result<(), RouterError> {
    let info = &infos[0];
    for (rank, i) in infos.iter().enumerate() {
        if i.block_size != info.block_size {
            return Err(RouterError::Mismatch(format!(
                "shard {rank} uses block_size {} but shard 0 uses {}",
                i.block_size, info.block_size
            )));
        }
        if i.world_size != 0 && i.world_size as usize != shards.world_size() {
            return Err(RouterError::Mismatch(format!(
                "shard {rank} has world_size {} but its group has {} --shard-uds-path",
                i.world_size,
                shards.world_size()
            )));
        }
    }
    Ok(())
}

/// Serves HTTP until SIGTERM or SIGINT, then drains (`drain`): the listener keeps
/// accepting, so late requests get their 503, until the requests in flight have ended or
/// `shutdown_timeout` is up; then the connections close once their responses are written
/// (bounded by the same timeout, or `FLUSH_GRACE` after a cut).
async fn serve_until_drained<L>(
    listener: L,
    app: Router,
    infer: &Infer,
    shutdown_timeout: Duration,
) -> Result<(), RouterError>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    let (close, closing) = tokio::sync::oneshot::channel::<()>();
    let mut http = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = closing.await;
            })
            .await
    });
    tokio::select! {
        joined = &mut http => return http_result(joined), // failed before any signal
        () = shutdown_signal() => {}
    }
    let deadline = tokio::time::Instant::now() + shutdown_timeout;
    let outcome = drain::drain(infer, shutdown_timeout).await;
    tracing::info!(?outcome, "drain over; closing the connections");
    let _ = close.send(());
    let until = deadline.max(tokio::time::Instant::now() + FLUSH_GRACE);
    match tokio::time::timeout_at(until, &mut http).await {
        Ok(joined) => http_result(joined),
        Err(_) => {
            tracing::warn!("connections still open after the shutdown timeout: dropped");
            Ok(())
        }
    }
}

fn http_result(joined: Result<std::io::Result<()>, JoinError>) -> Result<(), RouterError> {
    joined.map_err(std::io::Error::other)??;
    Ok(())
}

/// Rows of the model's logits (the tokenizer's size when the shard does not say).
fn logits_width(tokenizer: &TokenizerInfo, info: &pb::InfoResponse) -> usize {
    match info.vocab_size {
        0 => tokenizer.vocab_size(),
        n => n as usize,
    }
}

/// The grammar compiler for the model's vocabulary (its logits' width, its EOS ids), or
/// why structured outputs cannot be offered (constrained requests then get that reason).
fn structured_outputs(
    args: &Args,
    tokenizer: &TokenizerInfo,
    info: &pb::InfoResponse,
) -> Constraints {
    let width = logits_width(tokenizer, info);
    let bound = std::time::Duration::from_millis(args.grammar_compile_timeout_ms);
    let compiler = constraints::tok_env(tokenizer.tokenizer.clone(), width, &info.eos_token_ids)
        .and_then(|env| Compiler::new(&env, bound))
        .map(std::sync::Arc::new);
    if let Err(why) = &compiler {
        tracing::warn!(%why, "structured outputs are unavailable");
    }
    compiler
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {},
        _ = terminate => {},
    }
    tracing::info!("signal received: draining (new requests get 503)");
}
