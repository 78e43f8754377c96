//! Generates the gRPC client for the router ⇄ shard contract (`../proto/shard.proto`).
//! protoc comes from `protoc-bin-vendored`, so no system protoc is needed. Also names the
//! build for `cadence_build_info`: the git commit (`CADENCE_GIT_SHA` when set, else the
//! checkout's at the router's last compilation, else "unknown") and the compiler's version.

use std::process::Command;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    println!("cargo:rerun-if-changed=../proto/shard.proto");
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_protos(&["../proto/shard.proto"], &["../proto"])?;
    build_info();
    Ok(())
}

/// A command's first output line, when it ran and succeeded.
fn output(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    let line = text.lines().next()?.trim().to_string();
    (out.status.success() && !line.is_empty()).then_some(line)
}

fn build_info() {
    println!("cargo:rerun-if-env-changed=CADENCE_GIT_SHA");
    let sha = std::env::var("CADENCE_GIT_SHA")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| output("git", &["rev-parse", "--short=12", "HEAD"]));
    // Named again when the router itself is compiled again (its sources, manifest or
    // dependencies changed), not whenever the checkout moves to another commit: a commit
    // that changed only the Python side would recompile the whole crate for a new name
    // (minutes of a 2-core machine, in every test run's wheel build), and the router it
    // built would be the same. So the name is the commit checked out at the router's last
    // compilation.
    for path in ["src", "Cargo.toml", "../Cargo.lock"] {
        println!("cargo:rerun-if-changed={path}");
    }
    println!(
        "cargo:rustc-env=CADENCE_GIT_SHA={}",
        sha.as_deref().unwrap_or("unknown")
    );
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = output(&rustc, &["--version"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=CADENCE_RUSTC_VERSION={version}");
}
