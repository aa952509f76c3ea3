use std::process::ExitCode;

use clap::error::ErrorKind;
use efa_device_plugin::config::{self, Command};
use efa_device_plugin::{app, list};

fn main() -> ExitCode {
    let (command, settings) = match config::parse(std::env::args_os()) {
        Ok(parsed) => parsed,
        Err(err)
            if matches!(
                err.kind(),
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion
            ) =>
        {
            let _ = err.print();
            return ExitCode::SUCCESS;
        }
        Err(err) => {
            // One line that names the flag, variable or file: usage text would bury it.
            let rendered = err.render().to_string();
            eprintln!("{}", rendered.lines().next().unwrap_or("invalid arguments"));
            return ExitCode::from(2);
        }
    };
    let outcome = match command {
        Command::Run => app::serve(settings),
        Command::List { output } => list::print(&settings, output, &mut std::io::stdout()),
        #[cfg(feature = "demo")]
        Command::Demo => efa_device_plugin::demo::run(),
        Command::Config { schema: false } => serde_yaml::to_string(&settings)
            .map(|yaml| print!("{yaml}"))
            .map_err(Into::into),
        Command::Config { schema: true } => serde_json::to_string_pretty(&config::file_schema())
            .map(|json| println!("{json}"))
            .map_err(Into::into),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        // Found wrong only once the node is scanned, but still a setting: the same exit as a
        // bad flag.
        Err(err) if err.downcast_ref::<config::ConfigError>().is_some() => {
            eprintln!("{err}");
            ExitCode::from(2)
        }
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
