//! `GET /v1/models`: the base model under each served name, then the LoRA adapters requests may name, in vLLM's
//! shape (an adapter's `parent` is the base model, its `root` its folder).

use axum::extract::State;
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use crate::api::AppState;

#[derive(Serialize, ToSchema)]
pub struct Model {
    id: String,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
    /// The base model's id; an adapter's folder.
    root: String,
    /// An adapter's base model (null for the base model).
    parent: Option<String>,
}

#[derive(Serialize, ToSchema)]
pub struct ModelList {
    object: &'static str,
    data: Vec<Model>,
}

#[utoipa::path(get, path = "/v1/models", tag = "OpenAI", responses((status = 200, body = ModelList)))]
pub async fn models(State(state): State<AppState>) -> Json<ModelList> {
    let base = state.info.served_model_name.clone();
    let mut data: Vec<Model> = state
        .info
        .served_model_names
        .iter()
        .map(|name| Model {
            id: name.clone(),
            object: "model",
            created: 0,
            owned_by: "cadence",
            root: state.info.model_id.clone(),
            parent: None,
        })
        .collect();
    data.extend(state.infer.adapters().listed().into_iter().map(|a| Model {
        id: a.name,
        object: "model",
        created: 0,
        owned_by: "cadence",
        root: a.path.display().to_string(),
        parent: Some(base.clone()),
    }));
    Json(ModelList {
        object: "list",
        data,
    })
}
