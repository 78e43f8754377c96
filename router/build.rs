//! Generates the gRPC client for the router ⇄ shard contract (`../proto/shard.proto`).
//! protoc comes from `protoc-bin-vendored`, so no system protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    println!("cargo:rerun-if-changed=../proto/shard.proto");
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_protos(&["../proto/shard.proto"], &["../proto"])?;
    Ok(())
}
