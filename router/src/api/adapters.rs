//! A request's `model`: the base model or a LoRA adapter (as vLLM reads it).

use axum::http::StatusCode;

use super::error::ApiError;
use super::state::AppState;

/// The adapter a request's `model` names: None for the base model (its served name or
/// its id, or no `model`), an adapter's name, or 404 in OpenAI's shape when any LoRA
/// option is on. Without LoRA options every name is the base model (clients written for
/// TGI send any name).
pub(crate) fn model_adapter(
    state: &AppState,
    model: Option<&str>,
) -> Result<Option<String>, ApiError> {
    let adapters = state.infer.adapters();
    let Some(model) = model else {
        return Ok(None);
    };
    if model == state.info.served_model_name || model == state.info.model_id || model.is_empty() {
        return Ok(None);
    }
    if adapters.resolve(model) {
        return Ok(Some(model.to_string()));
    }
    if !adapters.enabled() {
        return Ok(None);
    }
    Err(ApiError::new(
        StatusCode::NOT_FOUND,
        "NotFoundError",
        format!("The model `{model}` does not exist."),
        Some("model".into()),
    ))
}
