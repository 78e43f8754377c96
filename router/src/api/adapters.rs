//! A request's `model`: the base model or a LoRA adapter (as vLLM reads it).

use super::error::ApiError;
use super::state::AppState;

/// The adapter a request's `model` names: None for the base model (one of its served
/// names or its id, or no `model`), an adapter's name, or a 404 in OpenAI's shape for any
/// other name, as vLLM answers (a client naming a model it is not talking to learns so).
/// TGI's routes do not ask: TGI serves any name.
pub(crate) fn model_adapter(
    state: &AppState,
    model: Option<&str>,
) -> Result<Option<String>, ApiError> {
    let Some(model) = model.filter(|m| !m.is_empty()) else {
        return Ok(None);
    };
    if state.info.names_base_model(model) {
        return Ok(None);
    }
    if state.infer.adapters().resolve(model) {
        return Ok(Some(model.to_string()));
    }
    Err(ApiError::model_not_found(model))
}
