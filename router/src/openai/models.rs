//! `GET /v1/models`: the one model this router serves.

use axum::extract::State;
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use crate::server::AppState;

#[derive(Serialize, ToSchema)]
pub struct Model {
    id: String,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
}

#[derive(Serialize, ToSchema)]
pub struct ModelList {
    object: &'static str,
    data: Vec<Model>,
}

#[utoipa::path(get, path = "/v1/models", tag = "OpenAI", responses((status = 200, body = ModelList)))]
pub async fn models(State(state): State<AppState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![Model {
            id: state.info.served_model_name.clone(),
            object: "model",
            created: 0,
            owned_by: "cadence",
        }],
    })
}
