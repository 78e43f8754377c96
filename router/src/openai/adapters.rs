//! vLLM's runtime adapter loading (a request's `model` naming an adapter is
//! `api::model_adapter`): `POST /v1/load_lora_adapter` `{lora_name, lora_path}` and
//! `POST /v1/unload_lora_adapter` `{lora_name}` (served with `--allow-runtime-lora` only,
//! else they are 404 as on vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING) answer 200 with
//! a line of text, or an error in OpenAI's shape (400, 404 for an unknown adapter, 409
//! while a name's previous adapter is still being unloaded).
//!
//! Unloading never cuts a request: the adapter is unregistered at once (not listed, new
//! requests get 404) and its weights are freed once the requests already using it end.

use std::path::PathBuf;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use utoipa::ToSchema;

use crate::api::{ApiError, AppState, OpenAiError, OpenAiJson};
use crate::lora::LoadError;

/// `POST /v1/load_lora_adapter`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct LoadLoraAdapterRequest {
    /// The name requests use (`model`, `parameters.adapter_id`).
    pub lora_name: Option<String>,
    /// The adapter's folder (PEFT: adapter_config.json, adapter_model.safetensors), as the
    /// shards see it.
    pub lora_path: Option<String>,
    /// vLLM's: accepted and ignored (a name is loaded once).
    #[serde(default)]
    pub load_inplace: Option<bool>,
}

/// `POST /v1/unload_lora_adapter`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct UnloadLoraAdapterRequest {
    pub lora_name: Option<String>,
    /// vLLM's: accepted and ignored (adapters go by name).
    #[serde(default)]
    pub lora_int_id: Option<i64>,
}

fn invalid_input(message: String) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "InvalidUserInput", message, None)
}

#[utoipa::path(post, path = "/v1/load_lora_adapter", request_body = LoadLoraAdapterRequest, tag = "OpenAI",
    responses((status = 200, description = "Loaded on every shard: `Success: LoRA adapter '<name>' added successfully.`", content_type = "text/plain"),
              (status = 400, body = OpenAiError), (status = 409, body = OpenAiError)))]
pub async fn load_lora_adapter(
    State(state): State<AppState>,
    OpenAiJson(r): OpenAiJson<LoadLoraAdapterRequest>,
) -> Result<Response, ApiError> {
    let (Some(name), Some(path)) = (
        r.lora_name.filter(|n| !n.is_empty()),
        r.lora_path.filter(|p| !p.is_empty()),
    ) else {
        return Err(invalid_input(
            "Both 'lora_name' and 'lora_path' must be provided.".into(),
        ));
    };
    if state.info.names_base_model(&name) {
        return Err(invalid_input(format!("'{name}' is the base model's name")));
    }
    let adapters = state.infer.adapters();
    match adapters.load_runtime(&name, &PathBuf::from(&path)).await {
        Ok(()) => Ok(format!("Success: LoRA adapter '{name}' added successfully.").into_response()),
        Err(LoadError::AlreadyLoaded) => Err(invalid_input(format!(
            "The lora adapter '{name}' has already been loaded."
        ))),
        Err(LoadError::BeingUnloaded) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "ConflictError",
            format!(
                "The lora adapter '{name}' is still being unloaded (its requests are \
                 finishing); try again shortly."
            ),
            None,
        )),
        Err(LoadError::InvalidName(why)) => Err(invalid_input(why)),
        Err(LoadError::Refused(why)) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "BadRequestError",
            format!("The lora adapter '{name}' ({path}) was refused: {why}"),
            None,
        )),
    }
}

#[utoipa::path(post, path = "/v1/unload_lora_adapter", request_body = UnloadLoraAdapterRequest, tag = "OpenAI",
    responses((status = 200, description = "Unregistered: `Success: LoRA adapter '<name>' removed successfully.` (its weights are freed once its requests end)", content_type = "text/plain"),
              (status = 400, body = OpenAiError), (status = 404, body = OpenAiError)))]
pub async fn unload_lora_adapter(
    State(state): State<AppState>,
    OpenAiJson(r): OpenAiJson<UnloadLoraAdapterRequest>,
) -> Result<Response, ApiError> {
    let Some(name) = r.lora_name.filter(|n| !n.is_empty()) else {
        return Err(invalid_input("'lora_name' must be provided.".into()));
    };
    if !state.infer.adapters().unload(&name) {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("The lora adapter '{name}' cannot be found."),
            None,
        ));
    }
    Ok(format!("Success: LoRA adapter '{name}' removed successfully.").into_response())
}
