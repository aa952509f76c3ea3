use std::io::Write;
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
            say(rendered.lines().next().unwrap_or("invalid arguments"));
            return ExitCode::from(2);
        }
    };
    let outcome = match command {
        Command::Run => app::serve(settings),
        Command::List { output } => list::print(
            &settings,
            output,
            &mut std::io::stdout(),
            &mut std::io::stderr(),
        ),
        #[cfg(feature = "demo")]
        Command::Demo => efa_device_plugin::demo::run(),
        Command::Settings { output } => config::print_settings(output, &mut std::io::stdout()),
        Command::Config { schema: false } => serde_yaml::to_string(&settings)
            .map_err(anyhow::Error::from)
            .and_then(|yaml| Ok(std::io::stdout().write_all(yaml.as_bytes())?)),
        Command::Config { schema: true } => serde_json::to_string_pretty(&config::file_schema())
            .map_err(anyhow::Error::from)
            .and_then(|json| Ok(writeln!(std::io::stdout(), "{json}")?)),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        // Found wrong only once the node is scanned, but still a setting: the same exit as a
        // bad flag.
        Err(err) if err.downcast_ref::<config::ConfigError>().is_some() => {
            say(&err.to_string());
            ExitCode::from(2)
        }
        Err(err) => {
            say(&format!("error: {err:#}"));
            ExitCode::FAILURE
        }
    }
}

/// One line on stderr. `eprintln!` panics when stderr is a closed pipe, and the release build
/// aborts on a panic: the exit status must still be the one chosen.
fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}
