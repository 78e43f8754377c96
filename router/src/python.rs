//! The extension module `cadence._router`: `serve(argv)` runs the router in the calling
//! Python process (`python -m cadence.router ARGS`); `flag_defaults()` tells the Python CLI
//! the router's defaults.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// Runs the router until SIGINT/SIGTERM. `argv` starts with the program name. The GIL is
/// released for the whole run; errors raise RuntimeError.
#[pyfunction]
fn serve(py: Python<'_>, argv: Vec<String>) -> PyResult<()> {
    py.detach(move || crate::run(argv))
        .map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// Every router flag's default as its command line spells it (`"--port"` → `"8080"`), for
/// the Python CLI's help; flags without a default are absent.
#[pyfunction]
fn flag_defaults() -> std::collections::HashMap<String, String> {
    crate::args::flag_defaults().into_iter().collect()
}

#[pymodule]
#[pyo3(name = "_router")]
fn router_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(serve, m)?)?;
    m.add_function(wrap_pyfunction!(flag_defaults, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
