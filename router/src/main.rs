//! `cadence-router`: the router as a standalone binary (the Python package runs the same
//! code through `cadence._router.serve`).

fn main() {
    if let Err(e) = cadence_router::run(std::env::args().collect()) {
        eprintln!("cadence-router: {e}");
        std::process::exit(1);
    }
}
