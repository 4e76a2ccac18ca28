"""Text for tools/bench_quant.py, written for it. Evaluation and calibration sets do not overlap."""

# 60 varied sentences: the MiniLM evaluation set.
EVAL_SENTENCES = [
    "The cat slept on the warm windowsill all afternoon.",
    "Interest rates rose for the third time this year, unsettling bond markets.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Could you send me the quarterly report by Friday?",
    "The striker scored twice in the final ten minutes to win the cup.",
    "Heavy rain is expected across the northern valleys tomorrow morning.",
    "She learned to play the cello at the age of forty.",
    "The compiler rejected the program because of a missing semicolon.",
    "Our flight was delayed by four hours due to a mechanical fault.",
    "Mix the flour and butter until the dough resembles breadcrumbs.",
    "The museum's new wing displays sculptures from ancient Greece.",
    "A black hole forms when a massive star collapses under its own gravity.",
    "He apologized for forgetting their anniversary and booked a dinner.",
    "The committee voted to postpone the decision until next spring.",
    "Regular exercise lowers the risk of heart disease and diabetes.",
    "The library will be closed on public holidays.",
    "Vaccines train the immune system to recognize specific pathogens.",
    "My grandmother grew tomatoes, beans and zucchini in her garden.",
    "The startup raised twelve million dollars in its first funding round.",
    "Glaciers in the Alps have lost a third of their volume since 1990.",
    "Please restart the router if the connection drops again.",
    "The novel follows a family of fishermen over three generations.",
    "Sound travels faster in water than in air.",
    "The judge dismissed the case for lack of evidence.",
    "Add a pinch of salt and stir the soup gently.",
    "Thousands of fans queued overnight for concert tickets.",
    "The new policy requires employees to change passwords every ninety days.",
    "Owls can rotate their heads by as much as 270 degrees.",
    "The bridge was closed after engineers found cracks in its supports.",
    "I prefer tea in the morning and coffee after lunch.",
    "Electric cars are becoming cheaper as battery costs fall.",
    "The orchestra rehearsed the symphony for six weeks before the premiere.",
    "Children under twelve must be accompanied by an adult.",
    "The spacecraft entered orbit around Jupiter after a five-year journey.",
    "He fixed the leaking tap with a new rubber washer.",
    "The city council approved funding for a new bicycle lane network.",
    "Most mammals have seven vertebrae in their necks, including giraffes.",
    "The exam covers algebra, geometry and basic probability.",
    "A sudden frost destroyed much of the vineyard's harvest.",
    "The detective noticed that the clock in the hallway had stopped.",
    "Machine translation has improved dramatically over the last decade.",
    "We hiked to the summit and watched the sunrise over the lake.",
    "The bakery on the corner sells the best croissants in town.",
    "Inflation erodes the purchasing power of savings held in cash.",
    "The patient was discharged after a week of observation.",
    "Bees communicate the location of flowers through a waggle dance.",
    "The software update fixes several security vulnerabilities.",
    "Their wedding took place in a small chapel by the sea.",
    "The river burst its banks, flooding hundreds of homes.",
    "Learning a second language can improve memory and attention.",
    "The printer is out of toner again.",
    "Ancient Romans built aqueducts to carry water into their cities.",
    "The referee showed him a red card for a dangerous tackle.",
    "Scientists sequenced the genome of a rare deep-sea octopus.",
    "I can't find my keys anywhere; have you seen them?",
    "The price of wheat doubled after the drought in the plains.",
    "She painted the kitchen walls a pale shade of yellow.",
    "Quantum computers use qubits that can exist in superpositions.",
    "The train to Edinburgh departs from platform nine.",
    "Volunteers planted two thousand trees along the riverbank.",
]

# A different set: calibration for MiniLM (never evaluated on).
CALIBRATION_SENTENCES = [
    "The farmer repaired the fence before the storm arrived.",
    "Stock prices fell sharply after the earnings announcement.",
    "Proteins fold into shapes that determine their function.",
    "Let's meet at the station at half past seven.",
    "The goalkeeper saved a penalty in the last minute of the match.",
    "Snow closed the mountain pass for most of the winter.",
    "He practices piano for an hour every evening.",
    "The database query timed out because the table had no index.",
    "Passengers must show their boarding passes at the gate.",
    "Simmer the sauce until it thickens, then season to taste.",
    "The gallery acquired a painting by a little-known Dutch artist.",
    "Neutron stars are among the densest objects in the universe.",
    "She wrote a long letter to her friend overseas.",
    "Parliament debated the budget late into the night.",
    "A balanced diet includes plenty of fruit and vegetables.",
    "The swimming pool reopens after renovation next month.",
    "Antibiotics are ineffective against viral infections.",
    "The apple trees blossomed early this year.",
    "The company announced plans to open three new factories.",
    "Sea levels are rising as polar ice melts.",
    "Try clearing your browser cache and logging in again.",
    "The poem describes a journey through a winter forest.",
    "Light from the Sun takes about eight minutes to reach Earth.",
    "The jury reached a verdict after two days of deliberation.",
    "Whisk the eggs with sugar until pale and fluffy.",
    "The festival attracted visitors from over forty countries.",
    "Staff must complete safety training before using the equipment.",
    "Dolphins sleep with one half of their brain at a time.",
    "Workers resurfaced the motorway over the weekend.",
    "The hotel offers free breakfast and parking for guests.",
    "Wind turbines generated a record share of electricity last year.",
    "The choir sang carols in the town square.",
]

# SmolLM2 evaluation text: several unrelated paragraphs (well over 500 tokens).
EVAL_TEXT = [
    "The history of the bicycle is a story of gradual refinement. Early machines in the nineteenth century "
    "had no pedals at all: riders pushed themselves along with their feet. Later designs added pedals to the "
    "front wheel, which grew ever larger to increase speed, until the safety bicycle, with two wheels of equal "
    "size and a chain driving the rear wheel, made cycling practical for ordinary people.",
    "To make a simple tomato sauce, warm some olive oil in a heavy pan and soften a chopped onion over low heat. "
    "Add two cloves of garlic, a tin of chopped tomatoes and a pinch of salt. Let it simmer for twenty minutes, "
    "stirring now and then, and finish it with a handful of torn basil leaves just before serving.",
    "Economists often distinguish between short-term fluctuations and long-term growth. In the short run, output "
    "can rise or fall with changes in demand, interest rates and confidence. Over decades, however, living "
    "standards depend mostly on productivity: how much value a worker can produce in an hour, which in turn "
    "depends on skills, technology, infrastructure and institutions.",
    "Dear Maria, thank you for your letter and for the photographs from your trip. The mountains look wonderful, "
    "and I am glad the weather was kind to you. We have had a quiet month here. The garden is finally recovering "
    "from the dry summer, and the children have started at their new school, which they seem to enjoy.",
    "A computer program is a sequence of instructions that a machine can execute. High-level languages let "
    "programmers describe what they want in terms closer to human thought, and a compiler translates that "
    "description into the simpler operations the processor understands. Good compilers also optimize the code, "
    "removing redundant work and making better use of memory and registers.",
    "The coral reefs of the tropics are home to an astonishing variety of life. Although they cover less than one "
    "percent of the ocean floor, they support roughly a quarter of all marine species. Warmer water, pollution and "
    "overfishing threaten many reefs, and scientists are studying how some corals manage to survive heat waves.",
    "When the old lighthouse keeper retired, the village held a small party in the harbour inn. He told stories "
    "about storms that lasted for days, ships that nearly ran aground, and the winter when the lamp failed and he "
    "kept a lantern burning all night by hand. Everyone agreed that the light would never feel quite the same.",
    "Learning to play a musical instrument takes patience. At first, even simple scales feel awkward and slow. "
    "With regular practice, the fingers remember the movements, and attention can shift from the mechanics to "
    "the music itself: phrasing, dynamics and the feeling the composer wanted to express.",
    "The city plans to expand its tram network over the next ten years. New lines will connect the university, "
    "the hospital and the growing neighbourhoods in the east. Officials hope the project will reduce traffic, "
    "cut air pollution and make it easier for people without cars to reach jobs and services.",
    "Sleep plays an important role in memory. During deep sleep, the brain appears to replay the experiences of "
    "the day, strengthening some connections and weakening others. People who are deprived of sleep often find "
    "it harder to concentrate, make more mistakes and struggle to learn new skills.",
]

# SmolLM2 calibration text: different paragraphs on different topics.
CALIBRATION_TEXT = [
    "Volcanoes form where molten rock from deep inside the Earth reaches the surface. Some erupt explosively, "
    "throwing ash high into the atmosphere, while others release slow rivers of lava that can flow for weeks. "
    "The soil around many volcanoes is unusually fertile, which is why people have farmed their slopes for "
    "thousands of years despite the danger.",
    "Before you start painting a room, move the furniture to the centre and cover it with old sheets. Fill any "
    "cracks in the walls, sand them smooth and wipe away the dust. Apply a coat of primer, wait for it to dry, "
    "and then paint from the top of the wall downwards using long, even strokes.",
    "The invention of the printing press changed how knowledge spread across Europe. Books that once took months "
    "to copy by hand could be produced in days, and their prices fell sharply. Literacy rose, new ideas travelled "
    "quickly between cities, and scholars could compare identical copies of the same text.",
    "Hi Tom, just a quick note to say the meeting has moved to Thursday afternoon. Could you bring the latest "
    "figures from the sales team and a few copies of the draft proposal? Let me know if the new time does not "
    "work for you and we can try to find another slot next week.",
    "A database stores information so that it can be retrieved and updated efficiently. Tables hold rows of "
    "records, indexes speed up searches, and transactions make sure that a group of changes either happens "
    "completely or not at all, even if the power fails in the middle of an update.",
    "Migrating birds travel thousands of kilometres each year between their breeding and wintering grounds. They "
    "navigate using the position of the sun, the patterns of the stars and even the Earth's magnetic field. Many "
    "species stop at the same wetlands every year to rest and feed before continuing their journey.",
    "The detective examined the room carefully. The window was locked from the inside, the desk drawers had been "
    "emptied onto the floor, and a half-finished cup of tea sat cold on the table. Whoever had been here had left "
    "in a hurry, but they had also known exactly what they were looking for.",
    "Running a small business means wearing many hats. The owner may handle sales in the morning, fix a broken "
    "machine at lunchtime and do the accounts late in the evening. Careful planning, loyal customers and a clear "
    "sense of what makes the business different are often the keys to surviving the first few years.",
    "Vaccination campaigns have eliminated smallpox and brought many other diseases close to eradication. "
    "Vaccines work by exposing the immune system to a harmless piece or version of a pathogen, so that the body "
    "can respond quickly and strongly if it ever meets the real infection.",
    "The football season ended with a dramatic final day. Three teams could still win the title, and the lead "
    "changed hands twice during the afternoon. In the end a late header decided the championship, and the "
    "supporters celebrated in the streets until long after midnight.",
]
