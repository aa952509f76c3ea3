# shellcheck shell=bash
# pinned_venv VENV PACKAGE==VERSION...: makes VENV hold exactly these pins,
# reusing it while they are unchanged; bumping a pin rebuilds it.
pinned_venv() {
	local venv=$1
	shift
	if [[ -f $venv/.pins && "$(<"$venv/.pins")" == "$*" ]]; then
		return 0
	fi
	rm -rf "$venv"
	python3 -m venv "$venv" &&
		"$venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir "$@" &&
		echo "$*" >"$venv/.pins"
}
