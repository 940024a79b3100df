"""Teaching helpers the notebooks use to show things: the model's anatomy (`anatomy`), memory
arithmetic (`memory`), and notebook display (`notebook`). The engine never imports them."""
