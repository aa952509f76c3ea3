//! The config file loader: arbitrary bytes as the file given by `--config`. It must answer
//! with settings or an error, never panic.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|contents: &[u8]| {
    let mut file = tempfile::NamedTempFile::new().expect("temp file");
    std::io::Write::write_all(&mut file, contents).expect("write config");
    let parsed = efa_device_plugin::config::parse([
        "efa-device-plugin".as_ref(),
        "--config".as_ref(),
        file.path().as_os_str(),
    ]);
    if let Err(err) = parsed {
        // What the user sees is the first line; it must say something.
        let rendered = err.render().to_string();
        assert!(
            !rendered
                .lines()
                .next()
                .unwrap_or_default()
                .trim()
                .is_empty()
        );
    }
});
