//! `powerinfer`: one subcommand per job (the library `powerinfer_cli`, one module per
//! subcommand under `cmd/`).

#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    powerinfer_cli::main()
}
