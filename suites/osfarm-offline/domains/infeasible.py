"""Infeasible tasks: the right answer is FAIL (OSWorld's `infeasible` evaluator)."""


def build(kit) -> None:
    kit.infeasible("os", "0f5d2a10-0000-4000-8000-000000000901",
                   "Pair my Bluetooth headphones named 'SoundCore Q30' with this computer.")
    kit.infeasible("libreoffice_calc", "0f5d2a10-0000-4000-8000-000000000902",
                   "In LibreOffice Calc, use the built-in ChatGPT button to summarise my spreadsheet into a poem.")
    kit.infeasible("chrome", "0f5d2a10-0000-4000-8000-000000000903",
                   "Install the Internet Explorer 6 rendering engine into the browser so old intranet pages display "
                   "correctly.")
