//! `powerinfer`: one subcommand per job (the library `powerinfer_cli`, one module per
//! subcommand under `cmd/`).

fn main() -> std::process::ExitCode {
    powerinfer_cli::main()
}
