//! `/v1/sessions` (issue 5). Routes are added here.

use super::Api;
use axum::Router;
use std::sync::Arc;

pub fn routes() -> Router<Arc<Api>> {
    Router::new()
}
